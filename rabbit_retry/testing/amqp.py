"""aiormq's face on the test broker: a connection and its channels, implementing what the worker
calls on ``AbstractConnection`` and ``AbstractChannel`` over one ``memory.Memory`` (test-only).

Each call behaves as aiormq makes it behave against RabbitMQ, where the worker's decisions
depend on it:

- a delivery runs its consumer callback as a task of its own, which the channel cancels when it
  closes; a closed channel's unacked deliveries go back to their queues (counted as returns);
- ``basic_ack`` / ``basic_nack`` / ``basic_reject`` settle one tag or, with ``multiple``, every
  tag up to it; an unknown tag closes the channel (``PRECONDITION_FAILED``), as RabbitMQ does;
- ``basic_publish`` marshals the properties as aiormq does (a ``message_id`` added when there
  is none); on a confirming channel it returns ``Basic.Ack``, raises ``PublishError`` for a
  mandatory publish nothing is bound for (``on_return_raises``, else the return callbacks run)
  and ``DeliveryError`` when a queue's overflow rule refuses it (a ``Basic.Nack``); a
  ``user_id`` other than the connection's user, an unknown exchange or a bad ``expiration``
  close the channel; a content header larger than the frame size closes the connection;
- a passive declare of what does not exist raises ``ChannelNotFoundEntity`` and closes the
  channel; ``closing`` futures resolve when a channel or the connection closes, with the reason.

``Observer`` hears every delivery, publish and settlement; ``harness`` reads decisions from it.
"""

# The channel and connection keep aiormq's signatures, ``timeout`` parameters included.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import aiormq.exceptions
from aiormq import spec
from aiormq.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractFutureStore,
    ArgumentsType,
    ConfirmationFrameType,
    ConsumerCallback,
    CoroutineType,
    DeliveredMessage,
    ExceptionType,
    TimeoutType,
)
from yarl import URL

from rabbit_retry.testing import frames
from rabbit_retry.testing.memory import BrokerError, Consumer, Entry, Memory, Queue, Routed

FRAME_MAX = 131072
FRAME_OVERHEAD = 8  # frame type, channel, size, end octet around a content header
CHANNEL_MAX = 2047

Settlement = Literal["ack", "nack", "reject", "closed"]

_ERRORS: dict[int, type[aiormq.exceptions.ChannelClosed]] = {
    403: aiormq.exceptions.ChannelAccessRefused,
    404: aiormq.exceptions.ChannelNotFoundEntity,
    405: aiormq.exceptions.ChannelLockedResource,
    406: aiormq.exceptions.ChannelPreconditionFailed,
}


def _channel_error(error: BrokerError) -> aiormq.exceptions.AMQPError:
    kind = _ERRORS.get(error.code)
    if kind is None:
        return aiormq.exceptions.ChannelClosed(error.code, error.text)
    return kind(error.text)


def _not_modelled(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not modelled by rabbit_retry.testing")


@dataclass(eq=False)
class Held:
    """A delivery its channel has not settled yet."""

    channel: Channel
    tag: int
    queue: Queue
    entry: Entry
    consumer: Consumer | None  # None: taken with basic.get
    message: DeliveredMessage
    task: asyncio.Task[Any] | None  # the task that handles it (its consumer callback's)


class Observer:
    """Hears what happens on the test broker's connections; every method does nothing here."""

    def delivered(self, held: Held) -> None:
        """``held`` was handed to a consumer or taken by ``basic.get``."""

    def published(
        self, channel: Channel, exchange: str, routing_key: str, message: DeliveredMessage,
        routed: Routed,
    ) -> None:
        """A publish on ``channel`` (in the publishing task) went to ``routed``."""

    def settled(self, held: Held, how: Settlement, requeue: bool, routed: Routed | None) -> None:
        """``held`` was settled ``how``; ``routed``: where a dead-lettered one went."""


def _observe(source: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """An observer of ``source`` that can be cancelled without touching it (as aiormq's
    ``closing``)."""
    if source.done():
        return source
    observer: asyncio.Future[Any] = source.get_loop().create_future()

    def copy(done: asyncio.Future[Any]) -> None:
        if observer.done():
            return
        if done.cancelled():
            observer.cancel()
        elif (exc := done.exception()) is not None:
            observer.set_exception(exc)
        else:
            observer.set_result(done.result())

    source.add_done_callback(copy)
    observer.add_done_callback(lambda f: f.cancelled() or f.exception())
    return observer


def _finish(future: asyncio.Future[Any], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
    future.exception()  # retrieved: nobody may be watching


class Server:
    """The broker side of every test connection: one ``Memory``, and its deliveries dispatched
    on the event loop soon after anything changes (never inside the call that changed it)."""

    def __init__(self, memory: Memory, observer: Observer | None = None) -> None:
        self.memory = memory
        self.observer = observer or Observer()
        self.connections: list[Connection] = []
        self.changes = 0  # bumped by every change: a waiter's way to see that something moved
        self.pending = False  # a dispatch is due
        self._scheduled = False  # and asked of the event loop
        self._waiters: list[asyncio.Future[None]] = []
        memory.changed = self.notify

    def notify(self) -> None:
        """Something changed: wake the waiters, and dispatch soon."""
        self.changes += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        self.pending = True
        self.kick()

    def kick(self) -> None:
        """Asks the running event loop (if any: a change from synchronous code waits for one)
        for the dispatch that is due."""
        if not self.pending or self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        loop.call_soon(self.dispatch)

    def dispatch(self) -> None:
        self._scheduled = self.pending = False
        self.memory.dispatch()

    async def changed(self, seconds: float) -> None:
        """Until the next change, or ``seconds``."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), seconds)
        except TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def connect(self, *, user: str = "guest", name: str = "test") -> Connection:
        connection = Connection(self, user=user, name=name)
        self.connections.append(connection)
        return connection

    def held(self) -> Iterator[Held]:
        """Every delivery not settled yet, on every open connection."""
        for connection in self.connections:
            yield from connection.held()


class _Closes:
    """What a channel and a connection share: a ``closing`` future that resolves (with the
    reason, if it was not a client's own close) when it closes."""

    _closing: asyncio.Future[Any]

    @property
    def closing(self) -> asyncio.Future[Any]:
        return _observe(self._closing)

    @property
    def is_closed(self) -> bool:
        return self._closing.done()

    def _future_store_child(self) -> AbstractFutureStore:
        raise _not_modelled("aiormq's future store")

    async def _on_close(self, exc: ExceptionType | None = None) -> None:
        return None


class Channel(_Closes, AbstractChannel):
    """One channel of a test ``Connection``."""

    connection: Connection

    def __init__(
        self, connection: Connection, number: int, *, publisher_confirms: bool,
        on_return_raises: bool,
    ) -> None:
        self.connection = connection
        self.number = number
        self.loop = asyncio.get_running_loop()
        self.publisher_confirms = publisher_confirms
        self.on_return_raises = on_return_raises
        self.on_return_callbacks = set()
        self.on_consumer_cancel_callbacks = set()
        self.consumers: dict[str, tuple[Consumer, ConsumerCallback]] = {}
        self.held: dict[int, Held] = {}
        self.delivery_tag = 0  # publishes counted for confirms
        self._delivered = 0  # deliveries counted for their tags
        self._prefetch = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing: asyncio.Future[Any] = self.loop.create_future()

    @property
    def server(self) -> Server:
        return self.connection.server

    @property
    def memory(self) -> Memory:
        return self.connection.server.memory

    def __str__(self) -> str:
        return f"test channel {self.number} of {self.connection}"

    # --- lifecycle -----------------------------------------------------------------------------

    def create_task(self, coro: CoroutineType) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def open(self) -> spec.Channel.OpenOk:
        return spec.Channel.OpenOk()

    async def close(
        self, exc: ExceptionType | None = asyncio.CancelledError, timeout: TimeoutType = None
    ) -> None:
        self.shut(None)

    def shut(self, exc: BaseException | None) -> None:
        """Closes the channel now: consumers gone, unacked deliveries back to their queues,
        its delivery tasks cancelled (as aiormq cancels a closed channel's consumer tasks)."""
        if self.is_closed:
            return
        _finish(self._closing, exc)
        self.connection.channels.pop(self.number, None)
        for consumer, _callback in self.consumers.values():
            self.memory.cancel(consumer)
        self.consumers.clear()
        for tag in sorted(self.held):
            held = self.held.pop(tag)
            self.server.observer.settled(held, "closed", True, None)
            self.memory.give_back(held.queue, held.entry, "close")
        for task in list(self._tasks):
            task.cancel()

    def _check_open(self) -> None:
        if self.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self} closed")

    def _fail(self, error: BrokerError) -> aiormq.exceptions.AMQPError:
        """The channel closed by the broker for ``error``; the exception its caller gets."""
        exc = _channel_error(error)
        self.shut(exc)
        return exc

    # --- declaring -----------------------------------------------------------------------------

    async def exchange_declare(  # type: ignore[override]
        self, exchange: str = "", *, exchange_type: str = "direct", passive: bool = False,
        durable: bool = False, auto_delete: bool = False, internal: bool = False,
        nowait: bool = False, arguments: ArgumentsType | None = None,
        timeout: TimeoutType = None,
    ) -> spec.Exchange.DeclareOk:
        self._check_open()
        try:
            self.memory.declare_exchange(
                exchange, exchange_type, passive=passive, durable=durable,
                auto_delete=auto_delete, internal=internal, arguments=arguments,
            )
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Exchange.DeclareOk()

    async def exchange_delete(  # type: ignore[override]
        self, exchange: str = "", *, if_unused: bool = False, nowait: bool = False,
        timeout: TimeoutType = None,
    ) -> spec.Exchange.DeleteOk:
        self._check_open()
        try:
            self.memory.delete_exchange(exchange)
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Exchange.DeleteOk()

    async def queue_declare(  # type: ignore[override]
        self, queue: str = "", *, passive: bool = False, durable: bool = False,
        exclusive: bool = False, auto_delete: bool = False, nowait: bool = False,
        arguments: ArgumentsType | None = None, timeout: TimeoutType = None,
    ) -> spec.Queue.DeclareOk:
        self._check_open()
        name = queue or f"amq.gen-{uuid.uuid4().hex}"
        try:
            declared = self.memory.declare_queue(
                name, passive=passive, durable=durable, exclusive=exclusive,
                auto_delete=auto_delete, arguments=arguments,
            )
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Queue.DeclareOk(queue=name, message_count=len(declared),
                                    consumer_count=len(declared.consumers))

    async def queue_bind(  # type: ignore[override]
        self, queue: str, exchange: str, routing_key: str = "", nowait: bool = False,
        arguments: ArgumentsType | None = None, timeout: TimeoutType = None,
    ) -> spec.Queue.BindOk:
        self._check_open()
        try:
            self.memory.bind(queue, exchange, routing_key, arguments)
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Queue.BindOk()

    async def queue_unbind(
        self, queue: str = "", exchange: str = "", routing_key: str = "",
        arguments: ArgumentsType | None = None, timeout: TimeoutType = None,
    ) -> spec.Queue.UnbindOk:
        self._check_open()
        try:
            self.memory.unbind(queue, exchange, routing_key, arguments)
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Queue.UnbindOk()

    async def queue_delete(  # type: ignore[override]
        self, queue: str = "", if_unused: bool = False, if_empty: bool = False,
        nowait: bool = False, timeout: TimeoutType = None,
    ) -> spec.Queue.DeleteOk:
        self._check_open()
        return spec.Queue.DeleteOk(message_count=self.memory.delete_queue(queue))

    async def queue_purge(  # type: ignore[override]
        self, queue: str = "", nowait: bool = False, timeout: TimeoutType = None
    ) -> spec.Queue.PurgeOk:
        self._check_open()
        try:
            return spec.Queue.PurgeOk(message_count=self.memory.purge(queue))
        except BrokerError as error:
            raise self._fail(error) from None

    # --- consuming -----------------------------------------------------------------------------

    async def basic_qos(
        self, *, prefetch_size: int | None = None, prefetch_count: int | None = None,
        global_: bool = False, timeout: TimeoutType = None,
    ) -> spec.Basic.QosOk:
        self._check_open()
        # Per consumer, for the consumers created after it (RabbitMQ's reading of global=false).
        self._prefetch = prefetch_count or 0
        return spec.Basic.QosOk()

    async def basic_consume(
        self, queue: str, consumer_callback: ConsumerCallback, *, no_ack: bool = False,
        exclusive: bool = False, arguments: ArgumentsType | None = None,
        consumer_tag: str | None = None, timeout: TimeoutType = None,
    ) -> spec.Basic.ConsumeOk:
        self._check_open()
        tag = consumer_tag or f"ctag{self.number}.{uuid.uuid4().hex}"
        if tag in self.consumers:
            raise aiormq.exceptions.DuplicateConsumerTag(self.number)
        try:
            target = self.memory.queue(queue)
        except BrokerError as error:
            raise self._fail(error) from None
        consumer = Consumer(
            tag, target, 0 if no_ack else self._prefetch,
            deliver=lambda entry: self._deliver(tag, entry, no_ack),
            cancelled=lambda: self._cancelled(tag),
        )
        self.consumers[tag] = (consumer, consumer_callback)
        self.memory.consume(queue, consumer)
        return spec.Basic.ConsumeOk(consumer_tag=tag)

    async def basic_cancel(  # type: ignore[override]
        self, consumer_tag: str, *, nowait: bool = False, timeout: TimeoutType = None
    ) -> spec.Basic.CancelOk:
        self._check_open()
        found = self.consumers.pop(consumer_tag, None)
        if found is not None:
            self.memory.cancel(found[0])
        return spec.Basic.CancelOk(consumer_tag=consumer_tag)

    def _cancelled(self, tag: str) -> None:
        """The broker cancelled consumer ``tag`` (its queue was deleted)."""
        if self.consumers.pop(tag, None) is None:
            return
        frame = spec.Basic.Cancel(consumer_tag=tag)
        for callback in list(self.on_consumer_cancel_callbacks):
            result = callback(frame)
            if asyncio.iscoroutine(result):
                self.create_task(result)

    def _message(self, delivery: Any, queue: Queue, entry: Entry) -> tuple[DeliveredMessage, bool]:
        header, redelivered = self.memory.render(queue, entry)
        delivery.redelivered = redelivered
        message = DeliveredMessage(
            delivery=delivery, header=frames.content_header(header),
            body=entry.content.body, channel=self,
        )
        return message, redelivered

    def _deliver(self, consumer_tag: str, entry: Entry, no_ack: bool) -> None:
        consumer, callback = self.consumers[consumer_tag]
        self._delivered += 1
        tag = self._delivered
        deliver = spec.Basic.Deliver(
            consumer_tag=consumer_tag, delivery_tag=tag, exchange=entry.content.exchange,
            routing_key=entry.content.routing_keys[0],
        )
        message, _ = self._message(deliver, consumer.queue, entry)
        held = Held(self, tag, consumer.queue, entry, consumer, message, None)
        if no_ack:
            consumer.unacked -= 1
        else:
            self.held[tag] = held
        held.task = self.create_task(callback(message))
        self.server.observer.delivered(held)

    async def basic_get(
        self, queue: str = "", no_ack: bool = False, timeout: TimeoutType = None
    ) -> DeliveredMessage:
        self._check_open()
        try:
            entry = self.memory.get(queue)
            target = self.memory.queue(queue)
        except BrokerError as error:
            raise self._fail(error) from None
        if entry is None:
            empty = DeliveredMessage(
                delivery=spec.Basic.GetEmpty(), header=frames.content_header(
                    frames.marshal(spec.Basic.Properties(), 0)), body=b"", channel=self,
            )
            return empty
        self._delivered += 1
        tag = self._delivered
        get_ok = spec.Basic.GetOk(
            delivery_tag=tag, exchange=entry.content.exchange,
            routing_key=entry.content.routing_keys[0], message_count=len(target),
        )
        message, _ = self._message(get_ok, target, entry)
        held = Held(self, tag, target, entry, None, message, asyncio.current_task())
        if not no_ack:
            self.held[tag] = held
        self.server.observer.delivered(held)
        return message

    # --- settling ------------------------------------------------------------------------------

    def _settle(self, tag: int, multiple: bool) -> list[Held]:
        if multiple:
            tags = [t for t in self.held if tag == 0 or t <= tag]
        elif tag in self.held:
            tags = [tag]
        else:
            tags = []
        if not tags:
            # RabbitMQ closes the channel; aiormq hears it after the call returned.
            self.shut(_channel_error(BrokerError(
                406, f"PRECONDITION_FAILED - unknown delivery tag {tag}")))
            return []
        settled = [self.held.pop(t) for t in sorted(tags)]
        for held in settled:
            if held.consumer is not None:
                held.consumer.unacked -= 1
        return settled

    async def basic_ack(
        self, delivery_tag: int, multiple: bool = False, wait: bool = True
    ) -> None:
        self._check_open()
        for held in self._settle(delivery_tag, multiple):
            self.server.observer.settled(held, "ack", False, None)
        self.server.notify()  # credit freed

    async def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True, wait: bool = True
    ) -> None:
        self._check_open()
        for held in self._settle(delivery_tag, multiple):
            self._refuse(held, "nack", requeue)
        self.server.notify()

    async def basic_reject(
        self, delivery_tag: int, *, requeue: bool = True, wait: bool = True
    ) -> None:
        self._check_open()
        for held in self._settle(delivery_tag, False):
            self._refuse(held, "reject", requeue)
        self.server.notify()

    def _refuse(self, held: Held, how: Literal["nack", "reject"], requeue: bool) -> None:
        if requeue:
            self.server.observer.settled(held, how, True, None)
            self.memory.give_back(held.queue, held.entry, how)
            return
        routed = self.memory.reject(held.queue, held.entry, how)
        self.server.observer.settled(held, how, False, routed)

    # --- publishing ----------------------------------------------------------------------------

    async def basic_publish(
        self, body: bytes, *, exchange: str = "", routing_key: str = "",
        properties: spec.Basic.Properties | None = None, mandatory: bool = False,
        immediate: bool = False, timeout: TimeoutType = None, wait: bool = True,
    ) -> ConfirmationFrameType | None:
        self._check_open()
        if len(routing_key) > 255:
            raise ValueError("Routing key too long (max 255 bytes)")
        properties = properties or spec.Basic.Properties(delivery_mode=1)
        if not properties.message_id:
            properties.message_id = uuid.uuid4().hex  # as aiormq: returns are matched by it
        header = frames.marshal(properties, len(body))
        if len(header) + FRAME_OVERHEAD > self.connection.connection_tune.frame_max:
            error = aiormq.exceptions.ConnectionFrameError(
                f"FRAME_ERROR - content header of {len(header)} bytes exceeds frame_max")
            self.connection.shut(error)
            raise error
        if properties.user_id and properties.user_id != self.connection.user:
            raise self._fail(BrokerError(
                406, f"PRECONDITION_FAILED - user_id property set to '{properties.user_id}' "
                f"but authenticated user was '{self.connection.user}'"))
        try:
            routed = self.memory.publish(exchange, routing_key, body, header)
        except BrokerError as error:
            raise self._fail(error) from None
        message = DeliveredMessage(
            delivery=spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange=exchange,
                                       routing_key=routing_key),
            header=frames.content_header(header), body=body, channel=self,
        )
        self.server.observer.published(self, exchange, routing_key, message, routed)
        if not self.publisher_confirms:
            return None
        self.delivery_tag += 1
        if routed.refused:
            raise aiormq.exceptions.DeliveryError(
                None, spec.Basic.Nack(delivery_tag=self.delivery_tag))
        if mandatory and not routed.queues:
            if self.on_return_raises:
                raise aiormq.exceptions.PublishError(message, message.delivery)
            for callback in list(self.on_return_callbacks):
                callback(message)
            return message  # type: ignore[return-value]  # as aiormq: the returned message
        return spec.Basic.Ack(delivery_tag=self.delivery_tag)

    # --- not modelled --------------------------------------------------------------------------

    async def basic_recover(  # type: ignore[override]
        self, *, nowait: bool = False, requeue: bool = False, timeout: TimeoutType = None
    ) -> spec.Basic.RecoverOk:
        raise _not_modelled("basic.recover")

    async def exchange_bind(  # type: ignore[override]
        self, destination: str = "", source: str = "", routing_key: str = "",
        nowait: bool = False, arguments: ArgumentsType | None = None,
        timeout: TimeoutType = None,
    ) -> spec.Exchange.BindOk:
        self._check_open()
        try:
            self.memory.bind_exchange(destination, source, routing_key, arguments)
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Exchange.BindOk()

    async def exchange_unbind(  # type: ignore[override]
        self, destination: str = "", source: str = "", routing_key: str = "",
        nowait: bool = False, arguments: ArgumentsType | None = None,
        timeout: TimeoutType = None,
    ) -> spec.Exchange.UnbindOk:
        self._check_open()
        try:
            self.memory.bind_exchange(destination, source, routing_key, arguments, unbind=True)
        except BrokerError as error:
            raise self._fail(error) from None
        return spec.Exchange.UnbindOk()

    async def flow(self, active: bool, timeout: TimeoutType = None) -> spec.Channel.FlowOk:
        raise _not_modelled("channel.flow")

    async def tx_commit(self, timeout: TimeoutType = None) -> spec.Tx.CommitOk:
        raise _not_modelled("transactions")

    async def tx_rollback(self, timeout: TimeoutType = None) -> spec.Tx.RollbackOk:
        raise _not_modelled("transactions")

    async def tx_select(self, timeout: TimeoutType = None) -> spec.Tx.SelectOk:
        raise _not_modelled("transactions")

    async def confirm_delivery(  # type: ignore[override]
        self, nowait: bool = False, timeout: TimeoutType = None
    ) -> spec.Confirm.SelectOk:
        self.publisher_confirms = True
        return spec.Confirm.SelectOk()


class Connection(_Closes, AbstractConnection):
    """A connection to the test broker, as ``aiormq.connect`` would give one."""

    def __init__(self, server: Server, *, user: str, name: str) -> None:
        self.server = server
        self.user = user
        self.name = name
        self.loop = asyncio.get_running_loop()
        version = server.memory.version.server
        self.server_properties = {
            "product": "RabbitMQ", "version": version, "cluster_name": "rabbit-retry-test",
            "capabilities": {
                "publisher_confirms": True, "basic.nack": True, "consumer_cancel_notify": True,
                "exchange_exchange_bindings": True, "connection.blocked": True,
                "per_consumer_qos": True,
            },
        }
        self.connection_tune = spec.Connection.Tune(
            channel_max=CHANNEL_MAX, frame_max=FRAME_MAX, heartbeat=60)
        self.channels: dict[int, AbstractChannel | None] = {}
        self.url = URL.build(scheme="amqp", user=user, host="rabbit-retry-test",
                             path=server.memory.vhost)
        self._closing: asyncio.Future[Any] = self.loop.create_future()
        self._numbers = iter(range(1, CHANNEL_MAX + 1))

    def __str__(self) -> str:
        return f"test connection {self.name!r}"

    @property
    def is_opened(self) -> bool:
        return not self.is_closed

    def create_task(self, coro: CoroutineType) -> asyncio.Task[Any]:
        return self.loop.create_task(coro)

    async def channel(
        self, channel_number: int | None = None, publisher_confirms: bool = True,
        frame_buffer_size: int = 10, timeout: TimeoutType = None, **kwargs: Any,
    ) -> Channel:
        if self.is_closed:
            raise RuntimeError("Connection closed")
        number = channel_number or next(self._numbers)
        channel = Channel(self, number, publisher_confirms=publisher_confirms,
                          on_return_raises=bool(kwargs.get("on_return_raises", True)))
        self.channels[number] = channel
        return channel

    async def close(
        self, exc: ExceptionType | None = asyncio.CancelledError, timeout: TimeoutType = None
    ) -> None:
        self.shut(exc if isinstance(exc, BaseException) else None)

    def shut(self, exc: BaseException | None) -> None:
        """Closes the connection and every channel on it now."""
        if self.is_closed:
            return
        for channel in list(self.channels.values()):
            if isinstance(channel, Channel):
                channel.shut(exc)
        _finish(self._closing, exc)
        if self in self.server.connections:
            self.server.connections.remove(self)

    def held(self) -> Iterator[Held]:
        """Every delivery not settled yet on this connection."""
        for channel in list(self.channels.values()):
            if isinstance(channel, Channel):
                yield from list(channel.held.values())

    def consumed(self) -> set[str]:
        """The queues this connection has a consumer on."""
        return {consumer.queue.name for channel in self.channels.values()
                if isinstance(channel, Channel) for consumer, _ in channel.consumers.values()}

    def set_close_reason(
        self, reply_code: int = 200, reply_text: str = "normally closed", class_id: int = 0,
        method_id: int = 0,
    ) -> None:
        return None

    async def connect(self, client_properties: Any = None) -> bool:
        return True

    async def ready(self) -> None:
        return None

    async def update_secret(
        self, new_secret: str, *, reason: str = "", timeout: TimeoutType = None
    ) -> spec.Connection.UpdateSecretOk:
        return spec.Connection.UpdateSecretOk()

    @property
    def server_capabilities(self) -> ArgumentsType:
        capabilities: ArgumentsType = self.server_properties["capabilities"]  # type: ignore[assignment]
        return capabilities

    @property
    def basic_nack(self) -> bool:
        return True

    @property
    def consumer_cancel_notify(self) -> bool:
        return True

    @property
    def accept_consumer_cancel_ok(self) -> bool:
        return True

    @property
    def exchange_exchange_bindings(self) -> bool:
        return False

    @property
    def publisher_confirms(self) -> bool | None:
        return True

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        await self.close()
        return None

