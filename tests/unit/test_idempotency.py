"""The worker's side of Idempotency (``Deduper``), over SQLite: keys, tickets, waiting for a
key another worker holds, a store that fails for a while, and what a consumer may declare."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from rabbit_retry.contract import HANDLE_AGAIN
from rabbit_retry.errors import InputError
from rabbit_retry.worker import Delivery, Idempotency, RetryConsumer
from rabbit_retry.worker.consumer import check_consumer
from rabbit_retry.worker.dedupe import Deduper
from rabbit_retry.worker.stores import Claim, Store, open_store


def delivery(message_id: str | None, **headers: Any) -> Delivery[Any]:
    return Delivery(body=b"{}", headers=MappingProxyType(headers), message_id=message_id,
                    correlation_id=None, routing_key="k", exchange="x", queue="q", attempt=1,
                    max_attempts=3)


def alive() -> bool:
    return True


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    opened = open_store(f"sqlite:///{tmp_path / 'keys.db'}")
    await opened.open()
    yield opened
    await opened.close()


async def test_a_done_key_is_a_duplicate_and_a_failed_one_is_free_again(store: Store) -> None:
    one = Deduper(Idempotency("sqlite:///x"), store, "q", "C", timeout=5.0)
    first = await one.admit(delivery("m-1"), None, alive)
    assert first.token is not None and not first.duplicate
    await one.failed(first, alive)
    again = await one.admit(delivery("m-1"), None, alive)
    assert again.token is not None and not again.duplicate
    await one.succeeded(again, alive)
    assert (await one.admit(delivery("m-1"), None, alive)).duplicate
    # The scope is the queue: the same id fanned out to another queue is handled there too.
    other = Deduper(Idempotency("sqlite:///x"), store, "q2", "C", timeout=5.0)
    assert not (await other.admit(delivery("m-1"), None, alive)).duplicate


async def test_a_key_held_elsewhere_is_waited_for_and_its_success_makes_a_duplicate(
    store: Store,
) -> None:
    one = Deduper(Idempotency("sqlite:///x"), store, "q", "A", timeout=5.0)
    two = Deduper(Idempotency("sqlite:///x"), store, "q", "B", timeout=5.0)
    held = await one.admit(delivery("m-1"), None, alive)
    waiting = asyncio.ensure_future(two.admit(delivery("m-1"), None, alive))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # positive control below: it finishes once the key is done
    await one.succeeded(held, alive)
    ticket = await asyncio.wait_for(waiting, 10)
    assert ticket.duplicate


async def test_a_key_held_by_a_dead_worker_is_taken_when_its_lease_runs_out(
    store: Store,
) -> None:
    dead = Deduper(Idempotency("sqlite:///x", lease=0.3), store, "q", "A", timeout=None)
    live = Deduper(Idempotency("sqlite:///x", lease=0.3), store, "q", "B", timeout=None)
    assert (await dead.admit(delivery("m-1"), None, alive)).token is not None
    ticket = await asyncio.wait_for(live.admit(delivery("m-1"), None, alive), 10)
    assert ticket.token is not None and not ticket.duplicate


async def test_waiting_ends_when_the_delivery_is_gone(store: Store) -> None:
    one = Deduper(Idempotency("sqlite:///x"), store, "q", "A", timeout=5.0)
    two = Deduper(Idempotency("sqlite:///x"), store, "q", "B", timeout=5.0)
    await one.admit(delivery("m-1"), None, alive)
    gone = await asyncio.wait_for(two.admit(delivery("m-1"), None, lambda: False), 10)
    assert gone.gone and gone.token is None


async def test_no_key_runs_the_handler_and_says_so_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rabbit_retry.worker")
    one = Deduper(Idempotency("sqlite:///x"), store, "q", "C", timeout=5.0)
    for _ in range(3):
        ticket = await one.admit(delivery(None), None, alive)
        assert ticket.key is None and not ticket.duplicate and not ticket.gone
    said = [r for r in caplog.records if "without a key" in r.getMessage()]
    assert len(said) == 1


async def test_handle_again_runs_a_done_key_and_a_custom_key_is_used(store: Store) -> None:
    rule = Idempotency("sqlite:///x", key=lambda d: d.headers.get("order"))
    one = Deduper(rule, store, "q", "C", timeout=5.0, user="worker")
    ticket = await one.admit(delivery("m-1", order="o-7"), None, alive)
    await one.succeeded(ticket, alive)
    assert (await one.admit(delivery("m-2", order="o-7"), None, alive)).duplicate
    asked = delivery("m-2", order="o-7", **{HANDLE_AGAIN: True})
    # Believed only from a replayer: the message's user_id, which the broker checked against
    # the connection that published it (the worker's own user by default).
    assert (await one.admit(asked, None, alive)).duplicate
    assert (await one.admit(asked, "publisher", alive)).duplicate
    again = await one.admit(asked, "worker", alive)
    assert not again.duplicate and again.key == "o-7"
    ops = Deduper(Idempotency("sqlite:///x", key=rule.key, replayers=("ops",)), store, "q", "C",
                  timeout=5.0, user="worker")
    assert (await ops.admit(asked, "worker", alive)).duplicate
    assert not (await ops.admit(asked, "ops", alive)).duplicate


class Flaky:
    """A store that fails its first ``failures`` calls, then delegates (a store outage)."""

    def __init__(self, inner: Store, failures: int) -> None:
        self.inner, self.failures, self.url = inner, failures, inner.url

    async def claim(self, scope: str, key: str, token: str, lease: float) -> Claim:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("store down")
        return await self.inner.claim(scope, key, token, lease)


async def test_a_failing_store_is_retried_while_the_delivery_waits(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rabbit_retry.worker.dedupe.STORE_RETRY", (0.01, 0.02))
    caplog.set_level(logging.WARNING, logger="rabbit_retry.worker")
    flaky = Flaky(store, failures=5)
    one = Deduper(Idempotency("sqlite:///x"), flaky, "q", "C", timeout=5.0)  # type: ignore[arg-type]
    ticket = await one.admit(delivery("m-1"), None, alive)
    assert ticket.token is not None and flaky.failures == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("idempotency store claim failed" in m for m in messages) == 1
    assert sum("works again" in m for m in messages) == 1


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (Idempotency(""), "Charge.idempotency.store: expected a store URL"),
        (Idempotency("sqlite:///x", window=0), "Charge.idempotency.window: expected a positive"),
        (Idempotency("sqlite:///x", lease=-1), "Charge.idempotency.lease: expected a positive"),
        (Idempotency("sqlite:///x", key="message_id"),  # type: ignore[arg-type]
         "Charge.idempotency.key: expected a function"),
    ],
)
def test_a_bad_idempotency_is_refused_in_one_line(rule: Idempotency, message: str) -> None:
    class Charge(RetryConsumer):
        queue = "payments.charge"
        idempotency = rule

        async def handle(self, delivery: object) -> None: ...

    with pytest.raises(InputError) as caught:
        check_consumer(Charge())
    assert str(caught.value).startswith(message)


def test_an_unknown_store_url_is_refused() -> None:
    with pytest.raises(InputError, match=r"expected sqlite:///PATH, postgresql://\.\.\. or redis://"):
        open_store("mysql://localhost/db")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://rr:s3cret@db/x", "postgresql://rr:***@db/x"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("postgresql://db/x?user=rr&password=s3cret&sslmode=require",
         "postgresql://db/x?user=rr&password=***&sslmode=require"),
        ("redis://cache/0?Password=s3cret", "redis://cache/0?Password=***"),
    ],
)
def test_store_urls_never_show_a_password(text: str, shown: str) -> None:
    from rabbit_retry.settings import mask

    assert mask(text) == shown
