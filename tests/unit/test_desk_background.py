"""The desk without a broker: how its ingest flusher takes what arrived, and how the releases
of discarded holders go out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiormq import spec

from rabbit_retry.desk.ingest import Ingest
from rabbit_retry.desk.store import Store
from rabbit_retry.settings import Settings


class _Channel:
    def __init__(self) -> None:
        self.acks: list[tuple[int, bool]] = []

    async def basic_ack(self, tag: int, multiple: bool = False) -> None:
        self.acks.append((tag, multiple))


class _Message:
    def __init__(self, tag: int) -> None:
        self.delivery = spec.Basic.Deliver(delivery_tag=tag)


async def test_a_flusher_woken_for_deliveries_a_lost_connection_took_waits_for_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection lost while deliveries waited to be stored leaves the flusher's wake-up set
    with nothing left to store. Before, the next session's flusher took an empty batch, failed
    on it (``max()`` of nothing) and ingest stopped for good while the page went on. Now it
    waits, and stores the next delivery that comes (the positive control)."""
    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    ingest = Ingest(store, Settings.from_env(), ["orders"])
    stored: list[list[Any]] = []

    async def record(taken: list[Any]) -> None:
        stored.append(taken)

    monkeypatch.setattr(ingest, "_store", record)
    channel = _Channel()
    ingest._arrived.set()  # what the lost session left
    ingest._pending = []
    flusher = asyncio.create_task(ingest._flush_forever(channel))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0.05)  # past its linger: it looked, and found nothing
    assert not flusher.done() and stored == []
    await ingest._arrival("orders")(_Message(7))  # type: ignore[arg-type]
    for _ in range(100):
        if channel.acks:
            break
        await asyncio.sleep(0.01)
    flusher.cancel()
    assert [[m.delivery.delivery_tag for _, m in batch] for batch in stored] == [[7]]
    assert channel.acks == [(7, True)]


async def test_a_release_for_a_queue_that_is_gone_does_not_hold_back_the_others(
    tmp_path: Path,
) -> None:
    """Discarding ordered keys' holders sends each key's queue a release. One whose queue is
    gone (the broker returns it) is let go with a warning; the others go out and are marked
    sent. Before, the return ended the round: the releases after it were never sent, and those
    before it were sent again every round."""
    import uuid
    from datetime import UTC, datetime

    import aiormq.exceptions

    from rabbit_retry.desk import actions
    from rabbit_retry.desk.records import parked
    from rabbit_retry.desk.store import Selection

    sent: list[str] = []

    class Channel:
        async def basic_publish(self, body: bytes, *, routing_key: str, **_: Any) -> None:
            if routing_key == "old-orders":
                returned = aiormq.exceptions.PublishError.__new__(
                    aiormq.exceptions.PublishError)
                Exception.__init__(returned, "312 NO_ROUTE")
                raise returned
            sent.append(routing_key)

        async def close(self) -> None:
            pass

    def holder(queue: str) -> Any:
        return parked(queue, b"x", spec.Basic.Properties(message_id=uuid.uuid4().hex, headers={
            "parked-id": uuid.uuid4().hex, "ordered-key": "k",
            "ordered-hold": uuid.uuid4().hex, "parked-reason": "exhausted"}),
            now=datetime.now(UTC))

    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    store.insert([holder("old-orders"), holder("orders"), holder("payments")],
                 datetime.now(UTC))
    desk = actions.Actions(store, Settings.from_env(), {"orders", "payments"})

    async def channel() -> Channel:
        return Channel()

    desk._channel = channel  # type: ignore[assignment,method-assign]
    assert await desk.discard(Selection(ids=(1, 2, 3)), "ana", "bad data") == 3
    assert sorted(sent) == ["orders", "payments"]
    assert desk.ledger.pending_releases() == []
