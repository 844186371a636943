"""``TestBroker``: a topology applied to the in-memory broker, the real worker run against it,
and what the worker decided for each delivery (test-only).

The worker is the production ``Runner`` with its ``Session``, lanes and publisher, unchanged:
only its connection is the test broker's (``Runner(connect=...)``). Its decisions are read off
the broker, as RabbitMQ would see them: an ack, an ack after a confirmed copy to a tier or to
parking, a ``nack``, a channel closed with the delivery unacked. A copy is matched to the
delivery whose task published it (the session publishes and acks in the delivery's own task),
or else by message id.

Time: the broker's clock is virtual. Messages wait in their tier until the test moves the clock
(``advance``, or ``settle(retries=True)``); each expiry happens at its own time, and the worker
settles what it brings before the clock moves on. The worker's own timers (handler timeouts, a
pause's probes, publish backoff) run on the event loop's real clock.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import json as jsonlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from aiormq import spec
from aiormq.abc import AbstractConnection, DeliveredMessage

from rabbit_retry.settings import Settings
from rabbit_retry.testing import frames
from rabbit_retry.testing.amqp import Channel, Connection, Held, Observer, Server, Settlement
from rabbit_retry.testing.memory import (
    VERSIONS,
    BrokerError,
    Discarded,
    Entry,
    Memory,
    Routed,
)
from rabbit_retry.topology import naming
from rabbit_retry.topology.resolved import Topology

if TYPE_CHECKING:
    from rabbit_retry.worker import RetryConsumer, Runner

DEFAULT_WITHIN = 10.0  # real seconds a settle may wait for the worker
MAX_EXPIRIES = 100_000  # a settle(retries=True) that never ends is a bug: say so
# Loop turns with nothing happening before a settle calls the worker at rest: what follows an
# ack (a lane moving its consumer, a resumed consumer's first delivery) takes a few.
QUIET_TURNS: Final = 5


class SettleTimeout(TimeoutError):
    """The worker did not come to rest in time; the message says what it was still doing."""


class Unroutable(ValueError):
    """A test's publish that reached no queue (or that a queue refused)."""


class Verdict(enum.StrEnum):
    """What became of one delivery, as the broker saw it."""

    ACKED = "acked"  # acked, nothing published for it
    RETRIED = "retried"  # a copy confirmed into a tier, or nack'ed into one by the broker
    PARKED = "parked"  # a copy confirmed into the parking queue, then acked
    SENT_BACK = "sent-back"  # a copy to the end of its own queue (a paused consumer's; on an
    # ordered queue from its lane back to ``Q``, holding its key)
    # Ordered queues: moved to its lane's held queue (an earlier message of its key waits), or
    # sent on from ``Q`` (back from a tier, replayed) to its key's lane.
    HELD = "held"
    FORWARDED = "forwarded"
    REQUEUED = "requeued"  # nack / reject with requeue
    DEAD_LETTERED = "dead-lettered"  # nack / reject without requeue, not into a tier
    UNSETTLED = "unsettled"  # its channel closed first: the broker delivers it again


@dataclass(frozen=True)
class Message:
    """A message as a client reads it: body, properties (decoded from the wire), where it was
    published or dead-lettered to, and whether the broker flagged it redelivered."""

    body: bytes
    properties: spec.Basic.Properties
    exchange: str = ""
    routing_key: str = ""
    redelivered: bool = False

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    @property
    def message_id(self) -> str | None:
        value: str | None = self.properties.message_id
        return value

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    @classmethod
    def delivered(cls, message: DeliveredMessage) -> Message:
        return cls(message.body, message.header.properties, message.exchange or "",
                   message.routing_key or "", bool(message.redelivered))

    def __repr__(self) -> str:
        return (f"<Message message_id={self.message_id!r} exchange={self.exchange!r} "
                f"routing_key={self.routing_key!r} body={len(self.body)} bytes>")


@dataclass(frozen=True)
class Decision:
    """What the worker did with one delivery.

    ``message`` is the delivery as the worker received it; ``to`` where the message went (a
    tier, the parking queue, its own queue) and ``copy`` what arrived there: the copy the worker
    published, or the message as the broker dead-lettered it.
    """

    verdict: Verdict
    queue: str
    message: Message
    to: str | None = None
    copy: Message | None = None

    @property
    def headers(self) -> dict[str, Any]:
        """The headers of what arrived at ``to`` (empty when nothing went anywhere)."""
        return self.copy.headers if self.copy is not None else {}

    @property
    def tier(self) -> str | None:
        """The tier queue a retried message waits in."""
        return self.to if self.verdict is Verdict.RETRIED else None

    @property
    def reason(self) -> str | None:
        """A parked copy's ``parked-reason``."""
        if self.verdict is not Verdict.PARKED:
            return None
        value = self.headers.get("parked-reason")
        return value if isinstance(value, str) else None

    @property
    def message_id(self) -> str | None:
        return self.message.message_id

    def __str__(self) -> str:
        where = f" -> {self.to}" if self.to else ""
        return f"{self.verdict.value} {self.message_id or '(no id)'} from {self.queue}{where}"


@dataclass(eq=False)
class _Open:
    """A delivery not settled yet, with the copies published for it."""

    held: Held
    copies: list[tuple[Routed, Message]]


class _Journal(Observer):
    """Turns what happens on the broker into ``Decision``s."""

    def __init__(self, roles: Mapping[str, tuple[str, str]]) -> None:
        self.roles = roles  # queue -> (role, the main queue it serves)
        self.decisions: list[Decision] = []
        self.memory: Memory | None = None
        self._open: dict[int, _Open] = {}  # id(held) -> it
        self._by_task: dict[asyncio.Task[Any], _Open] = {}

    def delivered(self, held: Held) -> None:
        record = _Open(held, [])
        self._open[id(held)] = record
        if held.task is not None:
            self._by_task[held.task] = record

    def published(
        self, channel: Channel, exchange: str, routing_key: str, message: DeliveredMessage,
        routed: Routed,
    ) -> None:
        if _bookkeeping(message):
            return
        record = None
        task = asyncio.current_task()
        if task is not None:
            record = self._by_task.get(task)
        message_id = message.header.properties.message_id
        own = None if record is None else record.held.message.header.properties.message_id
        if own and message_id and own != message_id:
            record = None  # a task that took several (an ordered lane's pass): by id instead
        if record is None or id(record.held) not in self._open:
            alike = [r for r in self._open.values()
                     if message_id and r.held.message.header.properties.message_id == message_id]
            record = alike[0] if len(alike) == 1 else None
        if record is not None:
            record.copies.append((routed, Message(message.body, message.header.properties,
                                                  exchange, routing_key)))

    def settled(self, held: Held, how: Settlement, requeue: bool, routed: Routed | None) -> None:
        record = self._open.pop(id(held), None)
        if held.task is not None and self._by_task.get(held.task) is record:
            del self._by_task[held.task]
        if _bookkeeping(held.message):  # a held queue's hold or release, a lane's nudge
            return
        copies = record.copies if record is not None else []
        self.decisions.append(self._decide(held, how, requeue, routed, copies))

    def _decide(
        self, held: Held, how: Settlement, requeue: bool, routed: Routed | None,
        copies: list[tuple[Routed, Message]],
    ) -> Decision:
        queue = held.queue.name
        message = Message.delivered(held.message)
        if how == "closed":
            return Decision(Verdict.UNSETTLED, queue, message)
        if requeue:
            return Decision(Verdict.REQUEUED, queue, message)
        if how != "ack":
            to = routed.queues[0] if routed is not None and routed.queues else None
            copy = self._dead_lettered(to, routed)
            verdict = Verdict.RETRIED if self._role(to) == "tier" else Verdict.DEAD_LETTERED
            return Decision(verdict, queue, message, to, copy)
        confirmed = [(r, m) for r, m in copies if r.queues and not r.refused]
        if not confirmed:
            return Decision(Verdict.ACKED, queue, message)
        where, copy = confirmed[-1]
        to = where.queues[0]
        role = self._role(to)
        if role == "tier":
            return Decision(Verdict.RETRIED, queue, message, to, copy)
        if role == "parking":
            return Decision(Verdict.PARKED, queue, message, to, copy)
        if role == "held":
            return Decision(Verdict.HELD, queue, message, to, copy)
        if role == "lane" and self._role(queue) == "main":
            return Decision(Verdict.FORWARDED, queue, message, to, copy)
        if role == "main" and self._role(queue) == "lane":  # a paused ordered queue's
            return Decision(Verdict.SENT_BACK, queue, message, to, copy)
        return Decision(Verdict.SENT_BACK if to == queue else Verdict.ACKED, queue, message, to,
                        copy)

    def _role(self, queue: str | None) -> str | None:
        found = self.roles.get(queue or "")
        return found[0] if found else None

    def _dead_lettered(self, to: str | None, routed: Routed | None) -> Message | None:
        """The message as a consumer of ``to`` will read it."""
        if to is None or routed is None or routed.content is None or self.memory is None:
            return None
        target = self.memory.queues.get(to)
        if target is None:
            return None
        content = routed.content
        header, redelivered = self.memory.render(target, Entry(content, -1, None))
        return Message(content.body, frames.unmarshal(header), content.exchange,
                       content.routing_keys[0], redelivered)


def _bookkeeping(message: DeliveredMessage) -> bool:
    """An ordered lane's own record (an entry of its held queue other than a message, a nudge,
    a fence or a passed entry of a change of its lanes): no message of the user's."""
    from rabbit_retry.contract import ORDERED_ENTRY, ORDERED_RELEASE

    headers = message.header.properties.headers or {}
    return (headers.get(ORDERED_ENTRY) not in (None, "message")
            or headers.get(ORDERED_RELEASE) == "")


class Worker:
    """A running worker (``TestBroker.worker``): the production ``Runner`` on the test broker."""

    def __init__(self, broker: TestBroker, runner: Runner) -> None:
        self.broker = broker
        self.runner = runner
        self.connections: list[Connection] = []
        self.task: asyncio.Task[None] | None = None

    async def connect(self, settings: Settings) -> AbstractConnection:
        connection = self.broker.server.connect(user=settings.user, name="rabbit-retry worker")
        self.connections.append(connection)
        return connection

    @property
    def connection(self) -> Connection | None:
        """Its current connection (None while it has none open)."""
        if self.connections and not self.connections[-1].is_closed:
            return self.connections[-1]
        return None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def at_rest(self) -> str | None:
        """None when the worker consumes every queue it should and holds no delivery; else
        what it is still doing."""
        if self.task is not None and self.task.done():
            return None
        connection = self.connection
        if not self.runner.ready.is_set() or connection is None:
            return "the worker is (re)connecting"
        # A paused ordered queue's lanes keep what has not started, waiting for a probe.
        waiting = {naming.lane_queue(sub.queue, lane) for sub in self.runner.subscriptions
                   if sub.breaker is not None and sub.breaker.paused and sub.config.ordered
                   for lane in range(sub.config.ordered.lanes)}
        held = [h for h in connection.held() if h.queue.name not in waiting]
        if held:
            ids = ", ".join(f"{h.queue.name}:{h.message.header.properties.message_id}"
                            for h in held[:5])
            return f"the worker holds {len(held)} unsettled deliveries ({ids})"
        consumed = connection.consumed()
        for sub in self.runner.subscriptions:
            paused = sub.breaker is not None and sub.breaker.paused
            if not paused and sub.queue not in consumed:
                return f"the worker is not consuming {sub.queue!r} yet"
        return None

    async def crash(self) -> None:
        """As if the worker's process died: its connection drops (the broker takes its unacked
        deliveries back, counting a return on each) and its handlers stop where they are."""
        connection = self.connection
        if connection is not None:
            import aiormq.exceptions

            connection.shut(aiormq.exceptions.ConnectionClosed(
                320, "CONNECTION_FORCED - the worker's process died"))
        if self.task is not None:
            self.task.cancel()
            with suppress(asyncio.CancelledError):
                await self.task

    async def stop(self) -> None:
        """Graceful stop (SIGTERM): in-flight handlers finish within the grace period."""
        if self.task is None or self.task.done():
            return
        self.runner.stop()
        await self.task


class TestBroker:
    """RabbitMQ in memory, with a topology applied as ``rabbit-retry apply`` would apply it.

    ``topology`` is the file (or its loaded ``Topology``; None: an empty vhost, for a test that
    declares its own objects over ``connect()``); ``version`` the RabbitMQ whose
    behaviour to follow: ``"3.10"``, ``"4.0"`` or ``"4.3"``. ``start`` is the virtual clock's
    start (default: now). Use it as ``async with TestBroker(...) as broker``.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self, topology: Topology | str | Path | None, *, version: str = "4.3",
        start: datetime.datetime | None = None, user: str = "guest",
    ) -> None:
        if isinstance(topology, str | Path):
            from rabbit_retry.topology.load import load_topology

            topology = load_topology(topology)
        if version not in VERSIONS:
            raise ValueError(f"version: one of {', '.join(VERSIONS)}, got {version!r}")
        from rabbit_retry.topology.compile import compile_topology
        from rabbit_retry.topology.plan import Plan

        self.topology = topology or Topology((), (), "<no topology>")
        self.plan = compile_topology(topology) if topology is not None else Plan((), (), ())
        self.user = user
        moment = start or datetime.datetime.now(datetime.UTC)
        self.memory = Memory(VERSIONS[version], start_ms=int(moment.timestamp() * 1000))
        self._journal = _Journal({q.name: (q.role, q.owner) for q in self.plan.queues})
        self._journal.memory = self.memory
        self.server = Server(self.memory, self._journal)
        self._apply()
        self._read = 0  # decisions already handed out by settle / advance
        self._workers: list[Worker] = []

    def _apply(self) -> None:
        policies = {p.queue: p.definition for p in self.plan.policies}
        for exchange in self.plan.exchanges:
            self.memory.declare_exchange(
                exchange.name, exchange.type, durable=exchange.durable,
                auto_delete=exchange.auto_delete, internal=exchange.internal,
                arguments=exchange.arguments,
            )
        for queue in self.plan.queues:
            self.memory.declare_queue(queue.name, durable=queue.durable,
                                      arguments=queue.arguments,
                                      policy=policies.get(queue.name))
        for binding in self.plan.bindings:
            if binding.destination_type == "exchange":
                self.memory.bind_exchange(binding.destination, binding.source,
                                          binding.routing_key, binding.arguments)
            else:
                self.memory.bind(binding.destination, binding.source, binding.routing_key,
                                 binding.arguments)

    async def __aenter__(self) -> TestBroker:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stops every worker still running and closes every connection."""
        for worker in self._workers:
            await worker.stop()
        for connection in list(self.server.connections):
            connection.shut(None)

    # --- what a test reads ---------------------------------------------------------------------

    @property
    def decisions(self) -> list[Decision]:
        """Every decision so far, in the order they were made."""
        return list(self._journal.decisions)

    @property
    def discarded(self) -> list[Discarded]:
        """Messages the broker let go of without a verdict (a dead-letter cycle, a queue
        without a dead-letter exchange, ...): empty while nothing was lost."""
        return list(self.memory.discarded)

    @property
    def now(self) -> datetime.datetime:
        """The virtual clock."""
        return datetime.datetime.fromtimestamp(self.memory.now_ms / 1000, datetime.UTC)

    def messages(self, queue: str) -> list[Message]:
        """What waits in ``queue``, head first, as a consumer would read it (left in place)."""
        try:
            target = self.memory.queue(queue)
        except BrokerError as exc:
            raise KeyError(queue) from exc
        out = []
        for entry in target.entries():
            header, redelivered = self.memory.render(target, entry)
            out.append(Message(entry.content.body, frames.unmarshal(header),
                               entry.content.exchange, entry.content.routing_keys[0],
                               redelivered))
        return out

    def parked(self, queue: str) -> list[Message]:
        """What waits in the parking queue of main queue ``queue``."""
        return self.messages(naming.parking_queue(queue))

    # --- what a test does ----------------------------------------------------------------------

    async def connect(self, settings: Settings | None = None) -> Connection:
        """A connection of its own to the broker, as ``aiormq.connect`` gives one."""
        return self.server.connect(user=(settings.user if settings else self.user))

    @asynccontextmanager
    async def worker(
        self, *consumers: RetryConsumer[Any], grace: float = 5.0
    ) -> AsyncIterator[Worker]:
        """Runs ``consumers`` in one worker for the block (the production ``Runner``)."""
        from rabbit_retry.worker import Runner
        from rabbit_retry.worker.metrics import Metrics

        settings = Settings(url=f"amqp://{self.user}@rabbit-retry-test/")
        worker: Worker | None = None

        async def connect(settings: Settings) -> AbstractConnection:
            assert worker is not None
            return await worker.connect(settings)

        runner = Runner(list(consumers), topology=self.topology, settings=settings, grace=grace,
                        metrics=Metrics(exported=False), connect=connect)
        worker = Worker(self, runner)
        worker.task = asyncio.create_task(runner.run())
        self._workers.append(worker)
        try:
            ready = asyncio.ensure_future(runner.ready.wait())
            await asyncio.wait({worker.task, ready}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if worker.task.done():
                worker.task.result()  # its startup error
            yield worker
        finally:
            await worker.stop()
            self._workers.remove(worker)

    def publish(
        self, body: bytes | str = b"", *, exchange: str = "", routing_key: str = "",
        queue: str | None = None, json: Any = None, headers: Mapping[str, Any] | None = None,
        message_id: str | None = None, correlation_id: str | None = None,
        content_type: str | None = None, expiration: str | int | None = None,
        priority: int | None = None, timestamp: datetime.datetime | None = None,
        message_type: str | None = None, user_id: str | None = None, app_id: str | None = None,
        reply_to: str | None = None, delivery_mode: int = 2,
        properties: spec.Basic.Properties | None = None, redelivered: bool | int = False,
    ) -> list[str]:
        """Publishes a message as a producer would (encoded by pamqp, as aio-pika sends it;
        pass ``properties`` encoded your own way instead of the keyword properties); returns the
        queues it reached. ``queue`` publishes straight to a queue (the default exchange);
        ``json`` is sent as a JSON body. ``redelivered`` puts it in its queue as a delivery
        that already came back (``True``: once; a number: that many times), as a crashed worker
        leaves it. ``Unroutable`` when it reaches no queue.
        """
        if queue is not None:
            if exchange or routing_key:
                raise ValueError("publish: give queue, or exchange and routing_key, not both")
            routing_key = queue
        if json is not None:
            body = jsonlib.dumps(json).encode()
            content_type = content_type or "application/json"
        data = body.encode() if isinstance(body, str) else body
        if properties is None:
            properties = spec.Basic.Properties(
                content_type=content_type, headers=dict(headers) if headers else None,
                delivery_mode=delivery_mode, priority=priority, correlation_id=correlation_id,
                reply_to=reply_to, expiration=None if expiration is None else str(expiration),
                message_id=message_id, timestamp=timestamp, message_type=message_type,
                user_id=user_id, app_id=app_id,
            )
        returns = int(redelivered)
        try:
            routed = self.memory.publish(exchange, routing_key, data,
                                         frames.marshal(properties, len(data)), returns=returns)
        except BrokerError as exc:
            raise Unroutable(exc.text) from None
        if routed.refused:
            raise Unroutable(f"refused by {', '.join(routed.refused)} (its overflow rule)")
        if not routed.queues:
            raise Unroutable(f"nothing is bound to exchange {exchange or '(default)'!r} with "
                             f"routing key {routing_key!r}")
        return list(routed.queues)

    def disconnect(self) -> None:
        """Closes every connection as a broker going away would (``CONNECTION_FORCED``): the
        unacked deliveries go back to their queues; a running worker reconnects."""
        import aiormq.exceptions

        for connection in list(self.server.connections):
            connection.shut(aiormq.exceptions.ConnectionClosed(
                320, "CONNECTION_FORCED - broker forced connection closure"))

    async def settle(
        self, *, retries: bool = False, expect: int = 0, within: float = DEFAULT_WITHIN
    ) -> list[Decision]:
        """Lets the worker handle everything it can now; the decisions made since the last
        ``settle`` or ``advance`` returned.

        ``retries``: then also move the clock through every delay until no message waits for
        one (every retry run to its end). ``expect``: first wait (real time, up to
        ``within``) until that many new decisions were made, for what the worker does on its
        own clock (a pause's probe). ``SettleTimeout`` when the worker does not come to rest
        ``within`` that many real seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while len(self._journal.decisions) - self._read < expect:
            if loop.time() >= deadline:
                raise SettleTimeout(
                    f"expected {expect} decisions, got {len(self._journal.decisions) - self._read}"
                )
            await self.server.changed(min(0.05, max(deadline - loop.time(), 0)))
            self._raise_worker_errors()
        await self._rest(deadline)
        if retries:
            for _ in range(MAX_EXPIRIES):
                due = self.memory.next_expiry()
                if due is None:
                    break
                self.memory.expire(due)
                await self._rest(deadline)
            else:
                raise SettleTimeout(f"messages still waiting after {MAX_EXPIRIES} expiries")
        return self._unread()

    async def advance(
        self, seconds: float, *, within: float = DEFAULT_WITHIN
    ) -> list[Decision]:
        """Moves the clock ``seconds`` on: every message whose TTL ends on the way expires at its
        time, and the worker settles what that brings before the clock moves further. The
        decisions made since the last ``settle`` or ``advance`` returned."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        until = self.memory.now_ms + round(seconds * 1000)
        await self._rest(deadline)
        while (due := self.memory.next_expiry()) is not None and due <= until:
            self.memory.expire(due)
            await self._rest(deadline)
        self.memory.expire(until)
        await self._rest(deadline)
        return self._unread()

    async def wait_for(
        self, check: Callable[[], object], *, what: str = "", within: float = DEFAULT_WITHIN
    ) -> None:
        """Until ``check()`` holds, the worker running meanwhile (real time: for what happens
        while a handler is still running, which ``settle`` would wait out); ``SettleTimeout``
        after ``within`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not check():
            self._raise_worker_errors()
            left = deadline - loop.time()
            if left <= 0:
                raise SettleTimeout(f"gave up after {within:g}s waiting for {what or check}"
                                    f" (discarded by the broker: {self.memory.discarded})")
            self.server.kick()
            await self.server.changed(min(0.01, left))

    def _unread(self) -> list[Decision]:
        fresh = self._journal.decisions[self._read:]
        self._read = len(self._journal.decisions)
        return fresh

    def _raise_worker_errors(self) -> None:
        for worker in self._workers:
            task = worker.task
            if task is not None and task.done() and not task.cancelled() \
                    and task.exception() is not None:
                task.result()

    def _unrest(self) -> str | None:
        """What keeps the broker and the workers from being at rest; None when they are."""
        if self.server.pending:
            return "deliveries are being dispatched"
        for worker in self._workers:
            busy = worker.at_rest()
            if busy is not None:
                return busy
        return None

    async def _rest(self, deadline: float) -> None:
        """Until every worker is at rest and nothing more happens for a few loop turns."""
        loop = asyncio.get_running_loop()
        while True:
            self.server.kick()
            self._raise_worker_errors()
            busy = self._unrest()
            if busy is None:
                changes = self.server.changes
                for _ in range(QUIET_TURNS):
                    await asyncio.sleep(0)
                if self.server.changes == changes and self._unrest() is None:
                    return
                continue
            left = deadline - loop.time()
            if left <= 0:
                raise SettleTimeout(f"not at rest: {busy}")
            if self.server.pending:
                await asyncio.sleep(0)  # the dispatch runs in this turn
            else:
                await self.server.changed(min(0.05, left))


class SyncTestBroker:
    """``TestBroker`` for synchronous tests: ``with SyncTestBroker(topology, Consumer()) as
    broker``. It runs an event loop of its own, only during each call (the broker's clock is
    virtual: nothing needs to run in between); ``consumers`` run in one worker throughout."""

    __test__ = False

    def __init__(
        self, topology: Topology | str | Path, *consumers: RetryConsumer[Any],
        version: str = "4.3", start: datetime.datetime | None = None, grace: float = 5.0,
    ) -> None:
        self.broker = TestBroker(topology, version=version, start=start)
        self._consumers = consumers
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: Any = None

    def _run(self, call: Any) -> Any:
        assert self._loop is not None, "use SyncTestBroker in a with block"
        return self._loop.run_until_complete(call)

    def __enter__(self) -> SyncTestBroker:
        self._loop = asyncio.new_event_loop()
        if self._consumers:
            self._worker = self.broker.worker(*self._consumers, grace=self._grace)
            self._run(self._worker.__aenter__())
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._worker is not None:
                self._run(self._worker.__aexit__(None, None, None))
            self._run(self.broker.close())
        finally:
            assert self._loop is not None
            self._loop.close()
            self._loop = None

    def publish(self, body: bytes | str = b"", **options: Any) -> list[str]:
        """``TestBroker.publish``."""
        return self.broker.publish(body, **options)

    def settle(self, **options: Any) -> list[Decision]:
        """``TestBroker.settle``."""
        result: list[Decision] = self._run(self.broker.settle(**options))
        return result

    def advance(self, seconds: float, **options: Any) -> list[Decision]:
        """``TestBroker.advance``."""
        result: list[Decision] = self._run(self.broker.advance(seconds, **options))
        return result

    @property
    def decisions(self) -> list[Decision]:
        return self.broker.decisions

    @property
    def discarded(self) -> list[Discarded]:
        return self.broker.discarded

    @property
    def now(self) -> datetime.datetime:
        return self.broker.now

    def messages(self, queue: str) -> list[Message]:
        return self.broker.messages(queue)

    def parked(self, queue: str) -> list[Message]:
        return self.broker.parked(queue)

