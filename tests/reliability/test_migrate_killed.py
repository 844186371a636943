"""``rabbit-retry migrate`` SIGKILLed twice while it moves a classic queue of 10,000 messages to
quorum and a publisher sends 2,000 more through the queue's exchange: a third run finishes, and
the queue is quorum and holds every message exactly once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.amqp import blocking, counts, drain_sync, persistent, publish_stream
from support.poll import wait_for
from support.process import CLI, apply, cli

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "rel.migrated"
HOLD = f"{Q}.migrating"
BEFORE, DURING = 10_000, 2_000
RATE = 250.0  # messages a second from the publisher while migrate runs


def _file(queue_type: str) -> str:
    return f"""\
version: 1
exchanges:
  shop: {{type: direct}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: shop, routing_key: order}}]
    retry: {{delays: [1s], max_attempts: 3}}
"""


def _ready(settings: Settings, queue: str) -> int:
    state = blocking(counts(settings, queue))
    return 0 if state is None else state[0]


def _queue_type(management: Management, settings: Settings) -> str | None:
    info = management.queue(settings.vhost, Q)
    return None if info is None else str(info.get("type"))


def _kill_when(settings: Settings, new: Path, reached: Callable[[], bool], what: str) -> None:
    migrate = subprocess.Popen(
        [CLI, "--url", settings.url, "--management-url", settings.management_url,
         "migrate", str(new), "--yes"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: reached() or migrate.poll() is not None, what, interval=0.02)
    finally:
        migrate.send_signal(signal.SIGKILL)
        out, err = migrate.communicate(timeout=30)
    assert migrate.returncode == -signal.SIGKILL, (what, out, err)


# 12,000 messages moved through two kills: a minute alone, several beside three other tests on a
# loaded machine.
@pytest.mark.timeout(900)
def test_migrate_killed_twice_while_publishing_keeps_every_message_exactly_once(
    fresh_vhost: Settings, management: Management, tmp_path: Path
) -> None:
    started = time.monotonic()
    old, new = tmp_path / "old.yml", tmp_path / "new.yml"
    old.write_text(_file("classic"))
    new.write_text(_file("quorum"))
    apply(fresh_vhost, old)
    blocking(publish_stream(fresh_vhost, "order", BEFORE,
                            lambda i: persistent(b'{"n": 1}', message_id=f"before-{i:05d}"),
                            exchange="shop"), timeout=600)
    assert _ready(fresh_vhost, Q) == BEFORE

    failures: list[BaseException] = []

    def publisher() -> None:
        try:
            asyncio.run(publish_stream(
                fresh_vhost, "order", DURING,
                lambda i: persistent(b'{"n": 2}', message_id=f"during-{i:04d}"),
                exchange="shop", rate=RATE,
            ))
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    publishing = threading.Thread(target=publisher)
    publishing.start()
    try:
        # Once while draining the old queue into the holding queue...
        _kill_when(fresh_vhost, new, lambda: _ready(fresh_vhost, HOLD) >= 3_000,
                   "3,000 messages in the holding queue")
        # ... once while moving them back into the new quorum queue.
        _kill_when(
            fresh_vhost, new,
            lambda: _queue_type(management, fresh_vhost) == "quorum"
            and _ready(fresh_vhost, Q) >= 3_000,
            "3,000 messages back in the new queue",
        )
        last = cli(fresh_vhost, "migrate", str(new), "--yes", timeout=600)
        assert last.code == 0, last.err
        # The parking queue follows the main queue's type: it is rebuilt too.
        assert (f"migrated 3 queues in vhost {fresh_vhost.vhost!r}: {Q}, {Q}.retry.1s, "
                f"{Q}.parking") in last.out
    finally:
        publishing.join(timeout=120)
    assert not failures, failures
    assert not publishing.is_alive()

    assert _queue_type(management, fresh_vhost) == "quorum"
    assert management.queue(fresh_vhost.vhost, HOLD) is None
    seen = Counter(str(m.message_id) for m in drain_sync(fresh_vhost, Q))
    expected = {f"before-{i:05d}" for i in range(BEFORE)}
    expected |= {f"during-{i:04d}" for i in range(DURING)}
    assert set(seen) == expected, (len(set(seen)), len(expected))
    twice = {k: v for k, v in seen.items() if v != 1}
    assert not twice, list(twice.items())[:10]
    print(f"[reliability] migrate killed twice, {sum(seen.values())} messages exactly once; "
          f"last run: {last.out.strip().splitlines()[-1]} ({time.monotonic() - started:.0f}s)")
