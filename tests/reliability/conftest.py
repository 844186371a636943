"""The reliability suite: fault injection against the real broker, with real worker processes.

Every test here is marked ``reliability`` (and ``integration``: it needs the broker) by
``tests/conftest.py``, which also gives the vhost fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_support import Worker
from support.broker import ctl
from support.report import on_failure

from rabbit_retry.broker.management import Management

LOG_TAIL = 80  # lines of each worker's log a failed test's report shows


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """Where the consumers of ``rel_consumers`` record calls and successes, and the worker logs."""
    path = tmp_path / "records"
    path.mkdir()
    return path


def _dlx_supervisor(management: Management) -> str:
    return ctl(management, "eval", "whereis(rabbit_fifo_dlx_sup).", timeout=60).strip()


@pytest.fixture
def dlx_guard(management: Management) -> Iterator[None]:
    """For tests that hand client-written ``x-death`` headers towards the broker's own
    dead-lettering: RabbitMQ 3.10's at-least-once dead-letter worker crashes on an entry that
    is not a table, and two crashes stop its supervisor, which breaks every quorum queue with
    at-least-once dead-lettering on the node (a shared broker). If that happened, restart the
    supervisor at once and fail the test, naming it."""
    # Positive control: the supervisor runs before the test, so "undefined" after it means died.
    assert _dlx_supervisor(management) not in ("", "undefined")
    yield
    if _dlx_supervisor(management) == "undefined":
        ctl(management, "eval", "supervisor:restart_child(rabbit_sup, rabbit_fifo_dlx_sup).",
            timeout=60)
        pytest.fail("the broker's quorum dead-letter supervisor (rabbit_fifo_dlx_sup) died "
                    "during this test: a client-written x-death reached the broker's "
                    "dead-lettering (restarted it)")


@pytest.fixture
def worker_guard(request: pytest.FixtureRequest) -> Iterator[list[Worker]]:
    """Kills whatever worker a failed test left running; the report of a failed test ends with
    the last lines of each worker's log (what a CI log needs to tell why it failed)."""
    made: list[Worker] = []
    on_failure(request.node, lambda: [
        (f"worker log {w.log_path}", "\n".join(w.log().splitlines()[-LOG_TAIL:]))
        for w in made])
    yield made
    for worker in made:
        worker.ensure_dead()
