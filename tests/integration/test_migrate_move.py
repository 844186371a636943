"""How ``rabbit-retry migrate`` moves messages from one queue to another on a real broker
(rabbit_retry/broker/migrate.py, ``MigrationRun.move``): many more than its window, copies
already at the destination, the marker of a refill, a source whose messages another consumer is
handed, a copy the broker returns or refuses, the order of a quorum queue it looks at, and a
window narrowed for large messages."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiormq
import pytest
from pamqp import commands as spec
from support.amqp import blocking, counts, drain_sync, publish_raw
from support.poll import eventually

from rabbit_retry.broker import migrate
from rabbit_retry.broker.connect import connect
from rabbit_retry.broker.management import Management
from rabbit_retry.broker.migrate import WINDOW, MigrationRun, Moved
from rabbit_retry.broker.migrate_plan import MARKER_HEADER, MARKER_VALUE, Copies
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings

SOURCE, TARGET = "mv.source", "mv.target"
BODY = b'{"n": 1}'


def _message(message_id: str) -> tuple[bytes, spec.Basic.Properties]:
    return BODY, spec.Basic.Properties(message_id=message_id, delivery_mode=2)


MARKER = (b"", spec.Basic.Properties(headers={MARKER_HEADER: MARKER_VALUE}, delivery_mode=2))


@asynccontextmanager
async def _run(settings: Settings) -> AsyncIterator[MigrationRun]:
    connection = await connect(settings, name="test migrate move")
    try:
        with Management.for_settings(settings) as api:
            yield MigrationRun(connection, api, settings, lambda _: None)
    finally:
        await connection.close()


async def _declare(settings: Settings, queue: str, arguments: dict[str, object]) -> None:
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel()
        await channel.queue_declare(queue, durable=True, arguments=arguments)  # type: ignore[arg-type]
    finally:
        await connection.close()


def _ready(settings: Settings, queue: str) -> int:
    state = blocking(counts(settings, queue))
    assert state is not None, queue
    return state[0]


def _ids(settings: Settings, queue: str) -> Counter[str]:
    return Counter(str(m.message_id) for m in drain_sync(settings, queue))


def _move(settings: Settings, *, marker: bool, peek: bool) -> Moved:
    async def go() -> Moved:
        async with _run(settings) as run:
            copies = await run.peek(TARGET) if peek else Copies()
            return await run.move(SOURCE, TARGET, copies, marker=marker)

    return blocking(go(), timeout=300)


def test_a_refill_larger_than_the_window_moves_each_message_once_and_stops_at_the_marker(
    fresh_vhost: Settings,
) -> None:
    many = 2 * WINDOW + 500
    blocking(_declare(fresh_vhost, SOURCE, {"x-queue-type": "classic"}))
    blocking(_declare(fresh_vhost, TARGET, {"x-queue-type": "quorum"}))
    # The holding queue of a refill: the held messages, the marker, then messages that were
    # routed to the new queue as well.
    after = [_message(f"after-{i}") for i in range(30)]
    blocking(publish_raw(
        fresh_vhost, [*(_message(f"m-{i}") for i in range(many)), MARKER, *after],
        routing_key=SOURCE,
    ))
    # The new queue: copies a killed run confirmed but never acked, and the routed ones.
    blocking(publish_raw(fresh_vhost, [*(_message(f"m-{i}") for i in range(100)), *after],
                         routing_key=TARGET))
    assert _ready(fresh_vhost, SOURCE) == many + 1 + 30

    moved = _move(fresh_vhost, marker=True, peek=True)

    assert (moved.moved, moved.dropped) == (many - 100, 100 + 30)
    assert _ready(fresh_vhost, SOURCE) == 0  # the marker too: acked last
    expected = Counter({f"m-{i}": 1 for i in range(many)} | {f"after-{i}": 1 for i in range(30)})
    assert _ids(fresh_vhost, TARGET) == expected


def test_a_source_handing_its_messages_to_another_consumer_is_moved_one_get_at_a_time(
    fresh_vhost: Settings,
) -> None:
    blocking(_declare(fresh_vhost, SOURCE, {"x-single-active-consumer": True}))
    blocking(_declare(fresh_vhost, TARGET, {}))
    blocking(publish_raw(fresh_vhost, [_message(f"m-{i}") for i in range(50)],
                         routing_key=SOURCE))
    held: list[str] = []

    async def go() -> Moved:
        # The single active consumer: it takes one message and holds it.
        other = await aiormq.connect(fresh_vhost.url)
        try:
            channel = await other.channel()
            await channel.basic_qos(prefetch_count=1)

            async def hold(message: aiormq.abc.DeliveredMessage) -> None:
                held.append(str(message.header.properties.message_id))

            await channel.basic_consume(SOURCE, hold)
            await eventually(lambda: held, what="the other consumer's first message")
            async with _run(fresh_vhost) as run:
                return await run.move(SOURCE, TARGET, Copies(), marker=False)
        finally:
            await other.close()

    moved = blocking(go(), timeout=120)
    assert held == ["m-0"]
    assert moved.moved == 49
    assert _ids(fresh_vhost, TARGET) == Counter({f"m-{i}": 1 for i in range(1, 50)})
    assert _ids(fresh_vhost, SOURCE) == Counter({"m-0": 1})  # given back when it closed


def test_a_copy_the_broker_returns_leaves_every_original_in_its_queue(
    fresh_vhost: Settings,
) -> None:
    blocking(_declare(fresh_vhost, SOURCE, {}))
    blocking(publish_raw(fresh_vhost, [_message(f"m-{i}") for i in range(300)],
                         routing_key=SOURCE))
    assert _ready(fresh_vhost, SOURCE) == 300

    with pytest.raises(BrokerError) as raised:
        _move(fresh_vhost, marker=False, peek=False)  # TARGET was never declared

    assert str(raised.value).startswith(
        f"moving {SOURCE} to {TARGET}: the broker returned a copy ("
    )
    assert str(raised.value).endswith("); the original stays in place")
    assert _ids(fresh_vhost, SOURCE) == Counter({f"m-{i}": 1 for i in range(300)})


def test_a_copy_the_broker_refuses_loses_no_message(fresh_vhost: Settings) -> None:
    blocking(_declare(fresh_vhost, SOURCE, {}))
    blocking(_declare(fresh_vhost, TARGET, {"x-max-length": 100, "x-overflow": "reject-publish"}))
    every = Counter({f"m-{i}": 1 for i in range(300)})
    blocking(publish_raw(fresh_vhost, [_message(m) for m in every], routing_key=SOURCE))

    with pytest.raises(BrokerError) as raised:
        _move(fresh_vhost, marker=False, peek=False)

    assert str(raised.value) == (
        f"moving {SOURCE} to {TARGET}: the broker refused a copy (publisher nack; is "
        f"{TARGET!r} full?); the original stays in place"
    )
    target = _ids(fresh_vhost, TARGET)
    assert sum(target.values()) == 100  # the copies it took, the positive control
    source = _ids(fresh_vhost, SOURCE)
    # Each original acked only after its copy was confirmed: every message is somewhere (some
    # in both: confirmed, never acked once a copy was refused).
    assert set(source) | set(target) == set(every)
    assert max(source.values()) == 1 and max(target.values()) == 1


def test_taking_stock_of_a_quorum_queue_keeps_its_order(fresh_vhost: Settings) -> None:
    blocking(_declare(fresh_vhost, TARGET, {"x-queue-type": "quorum",
                                            "x-delivery-limit": 2**31 - 1}))
    ids = [f"t-{i}" for i in range(200)]
    blocking(publish_raw(fresh_vhost, [_message(m) for m in ids], routing_key=TARGET))

    async def peek() -> int:
        async with _run(fresh_vhost) as run:
            return len(await run.peek(TARGET))

    assert blocking(peek()) == 200  # each one seen, none taken
    assert [str(m.message_id) for m in drain_sync(fresh_vhost, TARGET)] == ids


def test_larger_messages_move_with_a_smaller_window_each_once_and_in_order(
    fresh_vhost: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 KiB in flight: a window of 64 for these 1 KiB bodies, after a first round of 100.
    monkeypatch.setattr(migrate, "BYTES_IN_FLIGHT", 64 * 1024)
    assert migrate.window_for(1024) == 64
    blocking(_declare(fresh_vhost, SOURCE, {}))
    blocking(_declare(fresh_vhost, TARGET, {"x-queue-type": "quorum"}))
    ids = [f"m-{i}" for i in range(400)]
    body = b"x" * 1024
    blocking(publish_raw(
        fresh_vhost,
        [(body, spec.Basic.Properties(message_id=m, delivery_mode=2)) for m in ids],
        routing_key=SOURCE,
    ))

    moved = _move(fresh_vhost, marker=False, peek=True)

    assert (moved.moved, moved.dropped) == (400, 0)
    assert _ready(fresh_vhost, SOURCE) == 0
    assert [str(m.message_id) for m in drain_sync(fresh_vhost, TARGET)] == ids


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_a_queue_whose_messages_a_client_holds_taken_with_get_is_deleted_only_once_they_are_back(
    fresh_vhost: Settings, queue_type: str
) -> None:
    """Releasing a queue (delete it once empty and unused) while another client holds one of
    its messages taken with ``basic.get`` (``parking show``, a paused worker's probe): neither
    the exact counts nor ``if-empty`` see it, and before, the queue was deleted and the message
    lost when it was given back. Now release waits for it, drains it too, then deletes."""
    import asyncio

    from rabbit_retry.broker.migrate import Outcome, _release
    from rabbit_retry.topology.plan import Queue

    arguments: dict[str, object] = {"x-queue-type": queue_type}
    blocking(_declare(fresh_vhost, SOURCE, arguments))
    blocking(_declare(fresh_vhost, TARGET, {"x-queue-type": "quorum"}))
    blocking(publish_raw(fresh_vhost, [_message(f"m-{n}") for n in range(3)],
                         routing_key=SOURCE))

    async def go() -> None:
        holder = await aiormq.connect(fresh_vhost.url)
        try:
            channel = await holder.channel()
            got = await channel.basic_get(SOURCE, no_ack=False)
            assert isinstance(got.delivery, spec.Basic.GetOk)
            with Management.for_settings(fresh_vhost) as api:
                await eventually(lambda: (api.queue(fresh_vhost.vhost, SOURCE) or {}).get(
                    "messages_unacknowledged") == 1, what="the taken message in the statistics")

            async def give_back() -> None:
                await asyncio.sleep(3)
                await channel.basic_nack(got.delivery.delivery_tag, requeue=True)

            back = asyncio.create_task(give_back())
            async with _run(fresh_vhost) as run:
                await _release(run, Queue(SOURCE, "user", SOURCE, arguments), TARGET,
                               Outcome(SOURCE))
            await back
        finally:
            await holder.close()

    blocking(go(), timeout=200)
    assert blocking(counts(fresh_vhost, SOURCE)) is None  # deleted
    assert _ids(fresh_vhost, TARGET) == Counter({"m-0": 1, "m-1": 1, "m-2": 1})
