"""Talking to the broker under test over AMQP (test-only, shared with bench/): publishing with
publisher confirms, queue depths, draining, and channel operations by hand.

Everything is async; ``blocking`` runs one call from synchronous code, and the ``*_sync``
flavours are that for the calls synchronous tests make most. Publishing is always mandatory,
each message confirmed and none returned: a test or a benchmark never loses its input silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aio_pika
import aiormq
from aiormq import spec
from aiormq.abc import AbstractChannel

from rabbit_retry.contract import copy_properties
from rabbit_retry.settings import Settings

T = TypeVar("T")

# One short AMQP exchange run from synchronous code: a broker that stops answering fails it.
AMQP_TIMEOUT_S = 60.0
# Publishes in flight at a time when the caller does not say.
WINDOW = 1000


def blocking(call: Awaitable[T], timeout: float | None = AMQP_TIMEOUT_S) -> T:
    """Run ``call`` to completion from synchronous code (at most ``timeout`` seconds)."""

    async def main() -> T:
        return await asyncio.wait_for(call, timeout)

    return asyncio.run(main())


# --- connecting --------------------------------------------------------------------------------

_C = TypeVar("_C")
CONNECT_ATTEMPTS = 3


async def connected(connect: Callable[[str], Awaitable[_C]], url: str) -> _C:
    """``connect(url)``, tried again (up to ``CONNECT_ATTEMPTS`` times) when the broker drops the
    connection while it is being opened: a loaded CI machine's 4.0 node reset one in its
    handshake. What a test checks starts once it is open; a refused or failing broker still
    fails at the last attempt."""
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            return await connect(url)
        except (ConnectionError, aiormq.exceptions.AMQPConnectionError):
            if attempt == CONNECT_ATTEMPTS:
                raise
            await asyncio.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


# --- publishing --------------------------------------------------------------------------------


async def publish_stream(
    settings: Settings,
    routing_key: str,
    count: int,
    make: Callable[[int], aio_pika.Message],
    *,
    exchange: str = "",
    window: int = WINDOW,
    rate: float | None = None,
) -> float:
    """Publishes ``count`` messages, ``window`` in flight at a time; ``make(i)`` builds each one
    just before it is sent (so a timestamp in it is the send time). With ``rate``, sends small
    batches on a fixed schedule of ``rate`` messages a second. Returns the seconds it took."""
    if rate is not None:
        window = max(1, round(rate / 100))  # a batch every 10 ms
    connection = await connected(aio_pika.connect, settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        target = (
            channel.default_exchange
            if exchange == ""
            else await channel.get_exchange(exchange, ensure=False)
        )
        start = time.perf_counter()
        for offset in range(0, count, window):
            if rate is not None:
                ahead = start + offset / rate - time.perf_counter()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            await asyncio.gather(
                *(
                    target.publish(make(i), routing_key, mandatory=True)
                    for i in range(offset, min(count, offset + window))
                )
            )
        return time.perf_counter() - start


def persistent(body: bytes, **properties: Any) -> aio_pika.Message:
    return aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **properties)


async def publish(
    settings: Settings,
    body: bytes,
    *,
    exchange: str = "",
    routing_key: str,
    count: int = 1,
    **properties: Any,
) -> None:
    """``count`` persistent copies of ``body`` with ``properties``; several copies without a
    ``message_id`` are numbered ``m-0``, ``m-1``, ..."""

    def make(i: int) -> aio_pika.Message:
        props = dict(properties)
        if count > 1 and "message_id" not in props:
            props["message_id"] = f"m-{i}"
        return persistent(body, **props)

    await publish_stream(settings, routing_key, count, make, exchange=exchange)


@dataclass(frozen=True)
class Outgoing:
    """A persistent message with exactly these headers, as a producer of any language sends
    them (encoded by the worker's own table encoder: pamqp cannot send a non-UTF-8 string)."""

    message_id: str | None
    body: bytes
    headers: Mapping[str, Any] | None = None

    def wire(self) -> tuple[bytes, spec.Basic.Properties]:
        properties = spec.Basic.Properties(message_id=self.message_id, delivery_mode=2)
        return self.body, copy_properties(properties, self.headers or {})


async def publish_raw(
    settings: Settings,
    messages: Iterable[tuple[bytes, spec.Basic.Properties]],
    *,
    routing_key: str,
    exchange: str = "",
) -> None:
    """(body, properties) pairs sent with exactly these wire properties (aio-pika's Message
    would normalise them), in order, in confirmed batches; a batch the broker does not confirm
    within ``AMQP_TIMEOUT_S`` fails the call (a long stream on a loaded machine does not)."""
    pending = list(messages)
    connection = await connected(aiormq.connect, settings.url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        for start in range(0, len(pending), 50):
            confirms = await asyncio.wait_for(asyncio.gather(*(
                channel.basic_publish(body, exchange=exchange, routing_key=routing_key,
                                      mandatory=True, properties=properties)
                for body, properties in pending[start : start + 50]
            )), AMQP_TIMEOUT_S)
            assert all(isinstance(c, spec.Basic.Ack) for c in confirms), confirms
    finally:
        await connection.close()


async def publish_each(settings: Settings, bodies: Sequence[bytes], *, routing_key: str,
                       exchange: str = "") -> list[bytes]:
    """Publish ``bodies`` one at a time (persistent, mandatory), each confirmed before the next;
    returns those the broker refused (``basic.nack``: a full queue that rejects publishes). A
    returned (unroutable) message fails the call: it would be a lost input."""
    refused = []
    connection = await connected(aiormq.connect, settings.url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        for body in bodies:
            try:
                confirm = await channel.basic_publish(
                    body, exchange=exchange, routing_key=routing_key, mandatory=True,
                    properties=spec.Basic.Properties(delivery_mode=2, message_id=body.decode()))
            except aiormq.exceptions.DeliveryError as exc:
                assert isinstance(exc.frame, spec.Basic.Nack), exc  # not returned: refused
                refused.append(body)
                continue
            assert isinstance(confirm, spec.Basic.Ack), confirm
    finally:
        await connection.close()
    return refused


# --- reading queues ----------------------------------------------------------------------------


async def counts(settings: Settings, queue: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of ``queue`` right now, None when it does not exist. A
    passive declare answers exactly; the management API's counts lag by a stats interval."""
    connection = await connected(aiormq.connect, settings.url)
    try:
        channel = await connection.channel()
        try:
            ok = await channel.queue_declare(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        return int(ok.message_count or 0), int(ok.consumer_count or 0)
    finally:
        await connection.close()


async def depth(settings: Settings, queue: str) -> int | None:
    """Ready messages of ``queue`` (exact), None when it does not exist."""
    state = await counts(settings, queue)
    return None if state is None else state[0]


async def all_empty(settings: Settings, *queues: str) -> bool:
    """Every one of ``queues`` exists and has no ready message."""
    for name in queues:
        if await depth(settings, name) != 0:
            return False
    return True


@dataclass(frozen=True)
class Taken:
    """A message taken off a queue: its body and exact wire properties."""

    body: bytes
    properties: spec.Basic.Properties
    redelivered: bool = False

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    def __getattr__(self, name: str) -> Any:
        # message_id, content_type, timestamp, ...: the properties, read as on the message.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.properties, name)


# Deliveries a drain's consumer may have unacked at once.
DRAIN_WINDOW = 500


async def drain(settings: Settings, queue: str, *, consumer: bool = True) -> list[Taken]:
    """Take (and ack) every ready message of ``queue``, in order: what the queue counts through
    a consumer (one ``basic.get`` round trip per message took minutes for tens of thousands),
    then with ``basic.get`` until the queue says it is empty. ``consumer=False``: with
    ``basic.get`` only, for a queue whose consumers a worker watches (a paused worker's probe
    takes any consumer of an empty queue for another replica, and resumes)."""
    connection = await connected(aiormq.connect, settings.url)
    taken: list[Taken] = []
    try:
        channel = await connection.channel()
        declared = await channel.queue_declare(queue, passive=True)
        if declared.message_count and consumer:
            await _consume_counted(channel, queue, declared.message_count, taken)
        while True:
            message = await channel.basic_get(queue)
            if not isinstance(message.delivery, spec.Basic.GetOk):
                break
            taken.append(Taken(message.body, message.header.properties,
                               bool(message.delivery.redelivered)))
            await channel.basic_ack(message.delivery.delivery_tag)
    finally:
        await connection.close()
    return taken


async def _consume_counted(channel: AbstractChannel, queue: str, count: int,
                           taken: list[Taken]) -> None:
    """About ``count`` messages through a consumer, in order, acked in groups. Whatever the
    consumer received before its cancel is taken too (the queue may hold more than it said); a
    count ahead of the queue ends the wait after a quiet spell (``basic.get`` then finds it
    empty)."""
    arrived: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
    await channel.basic_qos(prefetch_count=min(count, DRAIN_WINDOW))
    consumer = await channel.basic_consume(queue, arrived.put)
    last = acked = 0

    def take(message: aiormq.abc.DeliveredMessage) -> None:
        nonlocal last
        taken.append(Taken(message.body, message.header.properties,
                           bool(message.delivery.redelivered)))  # type: ignore[union-attr]
        last = int(message.delivery.delivery_tag)  # type: ignore[union-attr,arg-type]

    try:
        for n in range(1, count + 1):
            try:
                take(await asyncio.wait_for(arrived.get(), 10))
            except TimeoutError:
                break
            if n % (DRAIN_WINDOW // 2) == 0:
                await channel.basic_ack(last, multiple=True)
                acked = last
    finally:
        await channel.basic_cancel(consumer.consumer_tag)  # type: ignore[arg-type]
    while not arrived.empty():
        take(arrived.get_nowait())
    if last > acked:
        await channel.basic_ack(last, multiple=True)


async def on_channel(
    settings: Settings, *calls: Callable[[AbstractChannel], Awaitable[Any]]
) -> None:
    """Channel operations by hand (``lambda ch: ch.queue_delete(...)``), in order, on one
    fresh channel: for what the product must meet but never does itself."""
    connection = await connected(aiormq.connect, settings.url)
    try:
        channel = await connection.channel()
        for call in calls:
            await call(channel)
    finally:
        await connection.close()


# --- the same, from synchronous code -----------------------------------------------------------


def publish_sync(settings: Settings, messages: Sequence[Outgoing], *, routing_key: str,
                 exchange: str = "") -> None:
    blocking(publish_raw(settings, [m.wire() for m in messages], routing_key=routing_key,
                         exchange=exchange), timeout=None)  # each batch has its own bound


def publish_stream_sync(settings: Settings, routing_key: str, count: int,
                        make: Callable[[int], aio_pika.Message], **kwargs: Any) -> float:
    """``publish_stream`` from synchronous code, however long it takes: the seconds it took."""
    return blocking(publish_stream(settings, routing_key, count, make, **kwargs), timeout=None)


@contextlib.asynccontextmanager
async def consuming(settings: Settings, queue: str) -> AsyncIterator[list[bytes]]:
    """A plain consumer of ``queue`` (another replica) acking every message, for the block;
    yields the bodies it took."""
    connection = await connected(aiormq.connect, settings.url)
    taken: list[bytes] = []
    try:
        channel = await connection.channel()

        async def take(message: aiormq.abc.DeliveredMessage) -> None:
            taken.append(message.body)
            await channel.basic_ack(message.delivery.delivery_tag)  # type: ignore[union-attr]

        await channel.basic_consume(queue, take)
        yield taken
    finally:
        await connection.close()


def depth_sync(settings: Settings, queue: str) -> int | None:
    return blocking(depth(settings, queue))


def consumers(settings: Settings, queue: str) -> int:
    """Consumers of ``queue`` (exact; 0 when it does not exist)."""
    state = blocking(counts(settings, queue))
    return 0 if state is None else state[1]


def total_depth(settings: Settings, queues: Iterable[str]) -> int:
    return sum(depth_sync(settings, q) or 0 for q in queues)


def drain_sync(settings: Settings, queue: str) -> list[Taken]:
    # One basic.get per message: thousands take longer than one short exchange on a busy
    # machine (tests run side by side), so only pyproject's per-test timeout bounds it.
    return blocking(drain(settings, queue), timeout=None)
