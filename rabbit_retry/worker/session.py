"""One connection's worth of consuming: deliveries in, decisions carried out, acks out.

A delivery's way through the worker is one sentence: read its history from its headers once
(``history``), run its handler if ``decide`` says so, ask ``decide`` for the one action its
outcome calls for, carry the action out. Carrying out is all this module does: an ack (in
groups: ``settle``), a ``nack``, or a copy published through the confirming ``Publisher`` (to a
tier, to parking, back to the queue) and acked only once confirmed. Every ack goes to the
channel the delivery came on. When the connection or a consuming channel is lost, ``lost``
resolves and whatever is still in flight is dropped: the broker has it back already.

Around it: a ``Lane`` per consumer (prefetch, and returned deliveries one at a time), its
``Pausing`` (a consumer's ``Pause``), ``journal`` (one log line per decision), ``shutdown``
(in-flight handlers finish within a grace period), and in a process that traces, ``tracing``
(each delivery's coroutine inside its span; told each decision). An ordered queue is consumed
as its lanes, each with an ``OrderedLane`` that admits a delivery when its key's turn has come
(``ordered``), and as ``Q`` itself, whose messages (back from a tier, replayed) are sent on to
the lanes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aiormq.exceptions
from aiormq import spec
from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

from rabbit_retry.contract import (
    ORDERED_KEY,
    ORDERED_RELEASE,
    ORIGINAL_ROUTING_KEY,
    as_text,
    new_message_id,
    republish_properties,
)
from rabbit_retry.settings import mask
from rabbit_retry.topology import naming
from rabbit_retry.topology.resolved import QueueConfig
from rabbit_retry.worker import journal, shutdown
from rabbit_retry.worker.batch import Batcher, outcomes
from rabbit_retry.worker.consumer import (
    NOT_DECODED,
    Delivery,
    RetryConsumer,
    ack_run,
    payload_error,
    prefetch,
)
from rabbit_retry.worker.deadlines import Deadlines
from rabbit_retry.worker.decide import (
    ACK,
    HANDLE,
    Action,
    Cause,
    NativeRetry,
    Outcome,
    Park,
    Requeue,
    Rules,
    TierRetry,
    classify,
    decide,
    runs_alone,
    uses_native_retry,
)
from rabbit_retry.worker.history import FIRST, History, read
from rabbit_retry.worker.lane import Lane
from rabbit_retry.worker.metrics import QueueMetrics
from rabbit_retry.worker.ordered import OrderedLane, Turn
from rabbit_retry.worker.ordering import Settled, holding_lane
from rabbit_retry.worker.pause import Breaker, Change
from rabbit_retry.worker.pausing import Pausing
from rabbit_retry.worker.publisher import DeliveryGone, Publisher
from rabbit_retry.worker.redelivery import counting, delivery_limit, with_policy_limit

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from pydantic import TypeAdapter

    from rabbit_retry.worker.copies import Failure
    from rabbit_retry.worker.dedupe import Deduper, Ticket
    from rabbit_retry.worker.tracing import Tracing

log = logging.getLogger("rabbit_retry.worker")

_NO_HEADERS: MappingProxyType[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Subscription:
    """A consumer with its queue's configuration, model adapter, metrics and copy targets."""

    consumer: RetryConsumer[Any]
    config: QueueConfig
    adapter: TypeAdapter[Any] | None
    metrics: QueueMetrics
    retry_exchange: str
    parking_queue: str
    call: Callable[[Delivery[Any]], Awaitable[Any]]  # the handler, as ``handler_call`` wraps it
    # Blocking ``def handle`` runs here (``prefetch`` threads); None for ``async def``.
    threads: ThreadPoolExecutor | None = None
    breaker: Breaker | None = None  # the consumer's Pause; lives as long as the runner
    deduper: Deduper | None = None  # the consumer's Idempotency, once its store is open
    deadlines: Deadlines = field(default_factory=Deadlines)  # its handlers' timeouts
    # An ordered queue's lanes: what each settled lately, kept across connections.
    settled: dict[int, Settled] = field(default_factory=dict)

    @property
    def queue(self) -> str:
        return self.config.name


@dataclass(eq=False)
class Stream:
    """One subscription consumed on this session: its rules for ``decide``, its lane (and the
    lane's settler), its pausing, and for a batch consumer its batcher."""

    sub: Subscription
    rules: Rules
    lane: Lane = field(init=False)
    pausing: Pausing | None = None
    batcher: Batcher | None = None
    order: OrderedLane | None = None  # one lane of an ordered queue


class Session:
    """Everything that lives and dies with one connection."""

    def __init__(
        self,
        connection: AbstractConnection,
        subscriptions: Sequence[Subscription],
        user: str,
        trace: Tracing | None = None,
        lanes: Mapping[str, int] | None = None,
    ) -> None:
        self.amqp = connection
        self.trace = trace
        # Per ordered queue, the lanes to consume: the file's, and those past them that
        # ``migrate`` is taking away (``runner.check_objects`` found them).
        self.lanes = dict(lanes or {})
        self.subscriptions = subscriptions
        self.user = user
        self.frame_max = int(self.amqp.connection_tune.frame_max or 131072)
        self.publisher = Publisher(self.amqp)
        self.streams: list[Stream] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.stopping = False  # a graceful stop: handlers cut off by the grace are sent back
        self._debug = log.isEnabledFor(logging.DEBUG)  # successes logged: read once
        self.amqp.closing.add_done_callback(lambda f: self._set_lost("the connection closed", f))
        self.counting = counting((self.amqp.server_properties or {}).get("version"))

    def _set_lost(self, what: str, future: asyncio.Future[Any] | None = None) -> None:
        if self.lost.done():
            return
        reason = what
        if future is not None and not future.cancelled():
            exc = future.exception()
            if exc is not None:
                reason = f"{what}: {mask(str(exc)) or type(exc).__name__}"
        self.lost.set_result(reason)

    async def start(self) -> None:
        deliver: Callable[..., Coroutine[Any, Any, None]] = self._deliver
        if self.trace is not None:  # decided once: an untraced delivery pays nothing for it
            deliver = self.trace.around(deliver)
        for sub in self.subscriptions:
            if sub.config.ordered is not None:
                await self._start_ordered(sub, deliver)
                continue
            channel = await self.amqp.channel(publisher_confirms=False)
            self._watch(channel, sub.queue)
            config = sub.config
            rules = self._rules(config)
            consumer = sub.consumer
            stream = Stream(sub, rules)
            lane = stream.lane = Lane(channel, sub.queue, prefetch(consumer), ack_run(consumer),
                                      partial(deliver, stream), self._set_lost)
            if consumer.batch is not None:
                stream.batcher = Batcher(consumer.batch, partial(self._run_batch, sub),
                                         self._track)
            if sub.breaker is not None:
                stream.pausing = Pausing(
                    sub.breaker, sub.queue, [lane], consumer.name, sub.metrics,
                    partial(deliver, stream, probe=True),
                    self._set_lost,
                )
            self.streams.append(stream)
            paused = sub.breaker is not None and sub.breaker.paused
            await lane.start(paused=paused)
            if stream.pausing is not None and paused:
                log.info("queue=%s stays paused; probing", sub.queue,
                         extra={"queue": sub.queue, "event": "paused"})
                stream.pausing.start_probe()
                continue
            log.info("consuming queue=%s consumer=%s prefetch=%d", sub.queue, consumer.name,
                     lane.prefetch, extra={"queue": sub.queue, "event": "consuming"})

    def _rules(self, config: QueueConfig, *, native: bool = True) -> Rules:
        return Rules(
            config.retry,
            config.queue_type,
            delivery_limit(config.queue_type,
                           with_policy_limit(config.arguments, config.policy), self.counting),
            self.counting,
            # A nack dead-letters with key Q, which goes to the tier only while the file does
            # not route Q's dead letters elsewhere (on_full / on_expire).
            native and config.dead_letter_route == "tier",
        )

    async def _start_ordered(
        self, sub: Subscription, deliver: Callable[..., Coroutine[Any, Any, None]]
    ) -> None:
        """``Q`` (forwarded to the lanes on every worker) and each lane of an ordered queue (the
        broker makes one worker at a time its consumer)."""
        ordered = sub.config.ordered
        assert ordered is not None
        consumer, queue = sub.consumer, sub.queue
        rules = self._rules(sub.config, native=False)
        lanes = naming.lanes_exchange(queue)
        count = self.lanes.get(queue, ordered.lanes)
        channel = await self.amqp.channel(publisher_confirms=False)
        self._watch(channel, queue)
        router = Stream(sub, rules)
        router.lane = Lane(channel, queue, prefetch(consumer), ack_run(consumer),
                           partial(self._forward, router, lanes, ordered.lanes), self._set_lost,
                           fixed=True)
        self.streams.append(router)
        await router.lane.start()
        paused = sub.breaker is not None and sub.breaker.paused
        pausing = None if sub.breaker is None else Pausing(
            sub.breaker, queue, [], consumer.name, sub.metrics, None, self._set_lost)
        for number in range(count):
            name = naming.lane_queue(queue, number)
            held = naming.held_queue(queue, number)
            channel = await self.amqp.channel(publisher_confirms=False)
            self._watch(channel, name)
            stream = Stream(sub, rules)
            lane = stream.lane = Lane(channel, name, prefetch(consumer), ack_run(consumer),
                                      partial(deliver, stream), self._set_lost, fixed=True)
            stream.order = OrderedLane(
                config=ordered, queue=queue, number=number, lane_queue=name, held_queue=held,
                lanes_exchange=lanes, channel=channel, settle=lane.settle,
                publisher=self.publisher, user=self.user,
                handle=partial(self._released, stream), lost=self._set_lost,
                # A lost ack is of a delivery still unacked to the broker: a prefetch's worth.
                settled=sub.settled.setdefault(number, Settled(max(64, 4 * prefetch(consumer)))),
            )
            if consumer.batch is not None:
                stream.batcher = Batcher(consumer.batch, partial(self._run_batch, sub),
                                         self._track)
            if pausing is not None:  # one for the queue: its lanes pause and resume together
                stream.pausing = pausing
                pausing.lanes.append(lane)
            self.streams.append(stream)
            await lane.start(paused=paused)
            sub.metrics.held_sources.append(stream.order.summary)
            declared = await channel.queue_declare(held, passive=True)
            if declared.message_count:
                # Whoever is the lane's active consumer reads its held queue at its next
                # delivery: give it one (an empty release) so that a lane with nothing new
                # coming hands back what a crashed worker left waiting.
                await self.publisher.publish(
                    "", name, b"", spec.Basic.Properties(
                        headers={ORDERED_RELEASE: ""}, delivery_mode=2,
                        message_id=new_message_id()))
        log.info("consuming queue=%s consumer=%s prefetch=%d (ordered, %d lanes%s)", queue,
                 consumer.name, prefetch(consumer), ordered.lanes,
                 "; paused, probing" if paused else "",
                 extra={"queue": queue, "event": "paused" if paused else "consuming"})
        if pausing is not None and paused:
            pausing.start_probe()

    async def _forward(
        self, stream: Stream, lanes: str, count: int, message: DeliveredMessage
    ) -> None:
        """A message back at an ordered queue's ``Q`` (from a tier, a replay, an operator's
        release): on to its key's lane, confirmed, then acked. A copy that holds its key (or
        releases it) goes straight to the lane that wrote the hold (``ORDERED_LANE``); anything
        else through the lanes exchange."""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        settle = stream.lane.settle
        tag: int = message.delivery.delivery_tag  # type: ignore[union-attr,assignment]
        settle.received(tag)
        props = message.header.properties
        headers = dict(props.headers or {})
        try:
            ring = (lanes, as_text(headers.get(ORDERED_KEY))
                    or as_text(headers.get(ORIGINAL_ROUTING_KEY))
                    or message.delivery.routing_key or "")  # type: ignore[union-attr]
            lane = holding_lane(headers, count)
            # A lane past this worker's file (migrate added it, or is taking it away; the
            # copy's writer had it) is on the broker unless it is gone (taken away, or the
            # queue made again with fewer): then the ring.
            direct = None if lane is None else ("", naming.lane_queue(stream.sub.queue, lane))
            await self.publisher.publish_held(
                *(direct or ring), message.body,
                republish_properties(props, headers, self.user),
                delivery_alive=lambda: not message.channel.is_closed,
                context={"queue": stream.sub.queue, "message_id": props.message_id},
                unroutable=ring if lane is not None and lane >= count else None,
            )
            settle.done(tag)
        except (DeliveryGone, aiormq.exceptions.ChannelInvalidStateError):
            log.debug("queue=%s: a delivery's channel closed; the broker has it back",
                      stream.sub.queue)
        finally:
            self.tasks.discard(task)

    async def _released(self, stream: Stream, message: DeliveredMessage, key: str) -> None:
        """A message of a key that is free again, from its lane's held queue: it has its key's
        turn and runs as a probe does, unless the lane is paused: then it waits where the
        lane's deliveries wait (for a probe or the resume)."""
        await self._deliver(stream, message, probe=not stream.lane.paused, released=key)

    def _watch(self, channel: AbstractChannel, queue: str) -> None:
        def closed(future: asyncio.Future[Any]) -> None:
            self._set_lost(f"the consuming channel of {queue!r} closed", future)

        async def cancelled(_frame: Any) -> None:
            self._set_lost(f"the broker cancelled the consumer of {queue!r}")

        channel.closing.add_done_callback(closed)
        channel.on_consumer_cancel_callbacks.add(cancelled)

    async def _deliver(
        self, stream: Stream, message: DeliveredMessage, probe: bool = False,
        released: str | None = None,
    ) -> None:
        """A delivery's task (aiormq's; a probe's ``basic.get`` runs in the probe's, a released
        message in its pass's): its history, its turn on the lane (``probe``: it has it), then
        ``_handle``; tracked for shutdown, counted in flight. One coroutine for all of it:
        this is most of the traffic, and each level of calls costs."""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        sub, lane = stream.sub, stream.lane
        sub.metrics.in_flight += 1
        # Consumers only get deliveries. (Annotations, not ``cast`` calls: each call costs.)
        deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
        tag: int = deliver.delivery_tag  # type: ignore[assignment]
        order = stream.order
        if released is None:  # a held queue's message was opened when its pass took it
            lane.settle.received(tag)
        history, entered = FIRST, False
        try:
            if order is not None or message.header.properties.headers or deliver.redelivered:
                history, ours = self._history(stream, message)
            else:  # a first delivery without headers (most of the traffic): nothing to read
                ours = False
            if order is not None and not await self._admit(order, task, message, history, ours,
                                                           released):
                return
            if history is not FIRST:
                # Parked on arrival, counted as a return, taken at its limit: none of it runs
                # the handler, so none of it waits for a turn.
                action = decide(history, Outcome.ARRIVED, stream.rules)
                if action is not HANDLE:
                    await self._carry_out(stream, message, history, action, None)
                    return
            if probe:
                alone = True
            else:  # its turn on the lane (a released message: beside the others, not alone)
                alone = released is None and history is not FIRST and runs_alone(
                    history, stream.rules.queue_type)
                entered = True
                if not lane.enter(task, alone) and not await self._turn(
                        stream, task, message, history, alone):
                    return
            await self._handle(stream, task, message, history, alone or released is not None)
        except (DeliveryGone, aiormq.exceptions.ChannelInvalidStateError):
            log.debug("queue=%s: a delivery's channel closed; the broker has it back", sub.queue)
        except Exception as exc:
            await self._internal_error(stream, message, history, exc)
        finally:
            if entered:
                lane.left(task)
            if order is not None:
                order.left(task)
            sub.metrics.in_flight -= 1
            self.tasks.discard(task)

    @staticmethod
    async def _admit(order: OrderedLane, task: asyncio.Task[Any], message: DeliveredMessage,
                     history: History, ours: bool, released: str | None) -> bool:
        """Its key's turn first, so anything it becomes is in order (a released message has
        it); False when the lane took care of it (moved, dropped, acked)."""
        if released is not None:
            order.turns[task] = Turn(released)
            return True
        return await order.admit(task, message, history, ours) is not None

    @staticmethod
    def _history(stream: Stream, message: DeliveredMessage) -> tuple[History, bool]:
        """The delivery's history, read once; and, on an ordered queue, whether it came by the
        queue's own route."""
        deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
        order = stream.order
        ours = order is not None and order.ours(deliver.exchange, deliver.routing_key)
        headers = message.header.properties.headers
        if not headers and not deliver.redelivered:
            return FIRST, ours
        return read(headers, bool(deliver.redelivered), deliver.exchange or "",
                    deliver.routing_key or "", stream.sub.queue,
                    None if order is None else ours), ours

    async def _turn(
        self, stream: Stream, task: asyncio.Task[Any], message: DeliveredMessage,
        history: History, alone: bool,
    ) -> bool:
        """Wait for the delivery's turn on the lane; False when it does not run after all (the
        lane paused: sent back unchanged; the lane stops: left to the broker)."""
        turn = await stream.lane.turn(task, alone, message.header.properties.message_id)
        if turn == "hold":
            await self._carry_out(stream, message, history,
                                  decide(history, Outcome.HELD, stream.rules), None)
            return False
        return turn != "stopped"

    async def _handle(
        self, stream: Stream, task: asyncio.Task[Any], message: DeliveredMessage,
        history: History, alone: bool = False,
    ) -> None:
        """Run the handler (``decide`` said so on arrival), decide on its outcome, carry it
        out. A batch consumer's delivery joins a batch for the call (``alone``: a batch of its
        own) and takes its own outcome from it."""
        sub, rules = stream.sub, stream.rules
        payload: Any = NOT_DECODED
        if sub.adapter is not None:
            payload, invalid = _decode(sub.adapter, message.body)
            if invalid is not None:
                stream.lane.ran(task)
                await self._carry_out(stream, message, history,
                                      decide(history, Outcome.INVALID, rules), invalid)
                return
        delivery = _delivery(message, history, sub.queue, rules.policy.max_attempts, payload)
        ticket: Ticket | None = None
        if sub.deduper is not None:
            ticket = await sub.deduper.admit(delivery, message.header.properties.user_id,
                                             lambda: not message.channel.is_closed)
            if ticket.gone:
                return
            if ticket.duplicate:
                stream.lane.ran(task)
                sub.metrics.duplicates += 1
                await self._carry_out(stream, message, history, ACK, None, duplicate=True)
                return
        outcome, error = await self._outcome(stream, task, delivery, alone)
        stream.lane.ran(task)
        change = Change.NONE
        if stream.pausing is not None:  # told as the handler returns, before anything awaits
            outcome, change = stream.pausing.heard(outcome, error, message)
        if ticket is not None:  # the success is recorded before the ack: a redelivery is a
            await self._settle_ticket(sub, ticket, outcome, message)  # duplicate then
        action = decide(history, outcome, rules)
        if action is ACK and stream.order is None:  # most of the traffic: nothing to await
            self._ack(stream, message, history, False)
        else:
            await self._carry_out(stream, message, history, action, error)
        if change is not Change.NONE:
            assert stream.pausing is not None
            await stream.pausing.carry_out(change)

    async def _outcome(
        self, stream: Stream, task: asyncio.Task[Any], delivery: Delivery[Any], alone: bool
    ) -> tuple[Outcome, BaseException | None]:
        """The handler's outcome (through the batch, for a batch consumer), and the exception
        it raised (None: none)."""
        sub = stream.sub
        try:
            if stream.batcher is None:
                result = await self._run(sub, task, delivery)
            else:
                result = await stream.batcher.join(delivery, alone=alone)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # Stopped past its grace: back to the queue as a copy, so that the next start
            # does not take it for a crash's return (run alone, counted toward the limit).
            return Outcome.HELD, None
        if not isinstance(result, BaseException):
            return result, None
        invalid = payload_error(delivery)
        outcome = classify(result, payload_invalid=invalid is not None,
                           permanent_errors=sub.consumer.permanent_errors)
        if outcome is Outcome.INVALID:
            return outcome, invalid or result
        return outcome, result

    @staticmethod
    async def _run(
        sub: Subscription, task: asyncio.Task[Any], delivery: Delivery[Any]
    ) -> Outcome | Exception:
        """The handler, under its timeout: SUCCESS, or the exception it raised (a timeout is
        a ``HandlerTimeout``)."""
        timeout = sub.consumer.handler_timeout
        started = time.perf_counter()
        if timeout is not None:
            # The consumer's ``Deadlines`` (one timer for all its deliveries) rather than
            # ``asyncio.timeout`` or a timer per delivery: a fraction of the cost. The
            # cancellation can only land while the handler is suspended, and the deadline is
            # dropped (``ended``) before anything else of ours awaits: it never hits our ack.
            sub.deadlines.start(task, timeout)
        try:
            result = await sub.call(delivery)
            if result is not None and inspect.isawaitable(result):
                # A handler that handed back its work (a decorator's wrapper, a plain def
                # returning a coroutine) has not run it yet: run it, under the same timeout.
                await result
        except BaseException as exc:
            what = exc if timeout is None else sub.deadlines.ended(task, exc, timeout)
            if not isinstance(what, Exception):  # a cancellation (shutdown), an exit
                raise
            sub.metrics.handler_seconds.observe(time.perf_counter() - started)
            return what
        if timeout is not None:
            sub.deadlines.ended(task, None, timeout)
        sub.metrics.handler_seconds.observe(time.perf_counter() - started)
        return Outcome.SUCCESS

    def _track(self, task: asyncio.Task[Any]) -> None:
        """A task that runs handler code for deliveries (a batch): shutdown waits for it."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _run_batch(
        sub: Subscription, deliveries: list[Delivery[Any]]
    ) -> list[Outcome | Exception]:
        """``handle_batch`` under the handler timeout (the whole call's), in the batch's own
        task; an outcome per delivery. Raising (or timing out) fails each with the exception."""
        task = asyncio.current_task()
        assert task is not None
        timeout = sub.consumer.handler_timeout
        started = time.perf_counter()
        if timeout is not None:
            sub.deadlines.start(task, timeout)
        try:
            # A list of its own: the handler may sort or empty it; the outcomes follow ours.
            returned = await sub.consumer.handle_batch(list(deliveries))
        except BaseException as exc:
            what = exc if timeout is None else sub.deadlines.ended(task, exc, timeout)
            if not isinstance(what, Exception):  # a cancellation (shutdown), an exit
                raise
            sub.metrics.handler_seconds.observe(time.perf_counter() - started)
            return [what] * len(deliveries)
        if timeout is not None:
            sub.deadlines.ended(task, None, timeout)
        sub.metrics.handler_seconds.observe(time.perf_counter() - started)
        return outcomes(deliveries, returned)

    @staticmethod
    async def _settle_ticket(
        sub: Subscription, ticket: Ticket, outcome: Outcome, message: DeliveredMessage
    ) -> None:
        assert sub.deduper is not None, "a ticket comes from the deduper"
        alive = lambda: not message.channel.is_closed  # noqa: E731
        if outcome is Outcome.SUCCESS:
            await sub.deduper.succeeded(ticket, alive)
        else:
            await sub.deduper.failed(ticket, alive)

    async def _carry_out(
        self,
        stream: Stream,
        message: DeliveredMessage,
        history: History,
        action: Action,
        error: BaseException | None,
        *,
        duplicate: bool = False,
    ) -> None:
        """Ack, nack, or publish a confirmed copy and then ack: ``action`` says which."""
        if action is ACK:  # most of the traffic: nothing else to build or say
            order = stream.order
            if order is not None:  # a holder handled: its key goes on
                await order.after_ack(order.turn_of(asyncio.current_task()))  # type: ignore[arg-type]
            self._ack(stream, message, history, duplicate)
            if order is not None:
                order.done(message)
            return
        failure = self._failure(stream, history, action, error)
        copy = None if isinstance(action, NativeRetry) else self._copy(stream, message, history,
                                                                       action, failure)
        if self.trace is not None:
            self.trace.decided(stream.sub.queue, history, action, error, failure,
                               copy[2] if copy is not None else None)
        if copy is None:
            await self._nack(stream, message)
        else:
            await self._publish_then_ack(stream, message, history, action, copy)
        self._count(stream.sub.metrics, action)
        journal.decision(stream.sub.queue, message.header.properties.message_id,
                         history.failures + 1, action, failure)

    def _ack(
        self, stream: Stream, message: DeliveredMessage, history: History, duplicate: bool
    ) -> None:
        """Done: acked with the lane's next run (a plain call: no await left on this path)."""
        sub = stream.sub
        stream.lane.settle.done(message.delivery.delivery_tag)  # type: ignore[union-attr,arg-type]
        if not duplicate:
            sub.metrics.success += 1
        if self.trace is not None:
            self.trace.decided(sub.queue, history, ACK, None, None, None, duplicate)
        if self._debug:
            journal.decision(sub.queue, message.header.properties.message_id,
                             history.failures + 1, ACK, None, duplicate=duplicate)

    @staticmethod
    async def _nack(stream: Stream, message: DeliveredMessage) -> None:
        """The broker retries it itself (the one tier of a quorum queue)."""
        settle = stream.lane.settle
        tag: int = message.delivery.delivery_tag  # type: ignore[union-attr,assignment]
        await settle.flush()  # the channel's acks go out before its nack
        await message.channel.basic_nack(tag, requeue=False)
        settle.elsewhere(tag)

    async def _publish_then_ack(
        self,
        stream: Stream,
        message: DeliveredMessage,
        history: History,
        action: Action,
        copy: tuple[str, str, dict[str, Any]],
    ) -> None:
        """The copy, confirmed (retried with backoff while the delivery lives), then the ack;
        on an ordered queue the copy holds its key (``OrderedLane.before_copy``)."""
        exchange, routing_key, headers = copy
        props = message.header.properties
        order = stream.order
        turn = None if order is None else order.turn_of(asyncio.current_task())  # type: ignore[arg-type]
        hold = None
        if turn is not None:
            assert order is not None
            hold = order.before_copy(turn, action, headers, props.message_id)
        try:
            await self.publisher.publish_held(
                exchange, routing_key, message.body,
                republish_properties(props, headers, self.user, expiration=None),
                delivery_alive=lambda: not message.channel.is_closed,
                context={"queue": stream.sub.queue, "message_id": props.message_id,
                         "attempt": history.failures + 1},
            )
        except BaseException:
            if hold is not None and turn is not None and order is not None:
                order.forget(turn.key, hold)
            raise
        if turn is not None and order is not None:
            await order.after_copy(turn, hold)
        stream.lane.settle.done(message.delivery.delivery_tag)  # type: ignore[union-attr,arg-type]
        if order is not None:
            order.done(message)

    @staticmethod
    def _count(metrics: QueueMetrics, action: Action) -> None:
        if isinstance(action, Park):
            metrics.parked += 1
            metrics.parked_by_reason[action.reason.value] += 1
        elif isinstance(action, NativeRetry | TierRetry):
            metrics.retried += 1

    def _copy(
        self,
        stream: Stream,
        message: DeliveredMessage,
        history: History,
        action: Action,
        failure: Failure | None,
    ) -> tuple[str, str, dict[str, Any]]:
        """Where the copy ``action`` calls for goes (exchange, routing key), and its headers."""
        from rabbit_retry.worker import copies  # loaded by the first failure

        sub = stream.sub
        props = message.header.properties
        deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
        original = history.source or (deliver.exchange or "", deliver.routing_key or "")
        expiration = props.expiration or history.moved_expiration
        if isinstance(action, Park):
            return "", sub.parking_queue, copies.parked_headers(
                props.headers, reason=action.reason.value, retry_count=action.retry_count,
                queue=sub.queue, original=original, failure=failure,
                now=datetime.now(UTC), parked_id=new_message_id(), expiration=expiration,
                frame_max=self.frame_max, elsewhere=self._elsewhere(stream, history),
            )
        if isinstance(action, TierRetry):
            return sub.retry_exchange, action.tier, copies.retry_headers(
                props.headers, retry_count=action.retry_count, original=original,
                expiration=expiration, failure=failure)
        assert isinstance(action, Requeue)
        return "", sub.queue, copies.retry_headers(
            props.headers, retry_count=action.retry_count, original=original,
            expiration=expiration, returns=action.returns)

    @staticmethod
    def _failure(
        stream: Stream, history: History, action: Action, error: BaseException | None
    ) -> Failure | None:
        """What a copy records of why: the handler's exception, or what stood in for a call."""
        if isinstance(action, Requeue):
            return None
        from rabbit_retry.worker import copies  # loaded by the first failure

        cause = getattr(action, "cause", Cause.HANDLER)
        if cause is Cause.DELIVERY_LIMIT:
            return copies.delivery_limit_failure(stream.sub.queue, stream.rules.return_limit or 0)
        if cause is Cause.ON_ARRIVAL:
            return copies.arrival_failure(stream.sub.queue, history,
                                          stream.rules.policy.max_attempts)
        return copies.Failure.from_exception(error) if error is not None else None

    @staticmethod
    def _elsewhere(stream: Stream, history: History) -> int:
        """Failures the broker recorded that were not this worker's: where the worker never
        lets the broker retry (``nack``) for this queue, every rejection in ``x-death`` is
        another consumer's. (Where it does, the two cannot be told apart.)"""
        rules = stream.rules
        native = rules.native and uses_native_retry(rules.policy, rules.queue_type)
        if native and rules.counting.native_cycle != "adds":
            return 0
        return history.broker_failures

    async def _internal_error(
        self, stream: Stream, message: DeliveredMessage, history: History, exc: Exception
    ) -> None:
        """A bug of ours, not the handler's. The delivery must not sit unacked holding a slot of
        the queue's prefetch: it is charged one failed attempt with the error (retried or
        parked like any failure), or if even that fails, sent through its retry tiers by the
        broker (``nack``) where its dead letters go there; elsewhere it stays unacked rather
        than be dropped. Counted in ``rabbit_retry_internal_errors_total``."""
        sub = stream.sub
        sub.metrics.internal_errors += 1
        message_id = message.header.properties.message_id
        log.exception("queue=%s message_id=%s: internal error; the message is charged a failed"
                      " attempt", sub.queue, message_id,
                      extra={"queue": sub.queue, "message_id": message_id,
                             "event": "internal_error"})
        tag: int = message.delivery.delivery_tag  # type: ignore[union-attr,assignment]
        if not stream.lane.settle.is_open(tag) or message.channel.is_closed:
            return
        try:
            await self._carry_out(stream, message, history,
                                  decide(history, Outcome.FAILED, stream.rules), exc)
        except Exception:
            if not stream.rules.native:
                # Its dead letters go to the parking queue or nowhere (on_full / on_expire), or
                # it is an ordered queue's lane: a nack would not take it to a tier. It stays
                # with the broker, unacked, until the channel closes.
                log.exception("queue=%s message_id=%s: the failure could not be carried out "
                              "either; left unacked (the broker has it back when the channel "
                              "closes)", sub.queue, message_id)
                return
            log.exception("queue=%s message_id=%s: the failure could not be carried out either;"
                          " the broker retries it (nack)", sub.queue, message_id)
            if stream.lane.settle.is_open(tag) and not message.channel.is_closed:
                try:
                    await message.channel.basic_nack(tag, requeue=False)
                    stream.lane.settle.elsewhere(tag)
                except Exception:  # the channel is gone: the broker has it back
                    pass

    async def shutdown(self, grace: float, force: asyncio.Event) -> None:
        """Stop new deliveries, give in-flight ones ``grace`` seconds, then close."""
        await self._stop_probes()
        for stream in self.streams:
            await stream.lane.stop(shutdown.CANCEL_TIMEOUT)
        await asyncio.sleep(0)  # deliveries still waiting for their turn leave, unstarted
        for stream in self.streams:
            if stream.batcher is not None:  # what a batch collected runs now, within the grace
                stream.batcher.close()
        self.stopping = True
        await shutdown.finish(self.tasks, grace, force)
        await self.close()

    async def _stop_probes(self) -> None:
        for stream in self.streams:
            if stream.pausing is not None:
                await stream.pausing.stop()
            if stream.order is not None:
                await stream.order.stop()
                held = stream.sub.metrics.held_sources
                if stream.order.summary in held:
                    held.remove(stream.order.summary)

    async def close(self) -> None:
        """Send the acks still due, close the connection, and drop whatever is still in
        flight: the broker requeues every unacked delivery of a closed channel, so finishing
        them here would only ack on a dead channel or race their redelivery."""
        await self._stop_probes()
        for stream in self.streams:
            if not stream.lane.channel.is_closed:
                try:
                    await stream.lane.settle.flush()
                except Exception as exc:  # a closing channel: those come back, as any unacked
                    log.debug("queue=%s: the last acks could not be sent: %r",
                              stream.sub.queue, exc)
        stale = [t for t in self.tasks if not t.done()]
        if stale:
            await shutdown.cancel(stale)
            log.info("dropped %d in-flight delivery(ies); the broker redelivers them", len(stale))
        await self.publisher.close()
        try:
            # As aio-pika closes it, so that a closing connection reads as closed on purpose.
            await self.amqp.close(aiormq.exceptions.ConnectionClosed)
        except Exception as exc:
            log.debug("closing the connection: %r", exc)


def _decode(adapter: Any, body: bytes) -> tuple[Any, Exception | None]:
    """The body validated by the consumer's model, or the validation error."""
    from pydantic import ValidationError  # loaded already: the adapter is pydantic's

    try:
        return adapter.validate_json(body), None
    except ValidationError as exc:
        return NOT_DECODED, exc


def _delivery(
    message: DeliveredMessage, history: History, queue: str, max_attempts: int, payload: Any
) -> Delivery[Any]:
    """What the handler is given: the message as first published (``history.source``)."""
    props = message.header.properties
    deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
    exchange, routing_key = history.source or (deliver.exchange or "",
                                               deliver.routing_key or "")
    headers = props.headers
    return Delivery(
        message.body,
        MappingProxyType(headers) if headers else _NO_HEADERS,
        props.message_id,
        props.correlation_id,
        routing_key,
        exchange,
        queue,
        history.failures + 1,  # attempt
        max_attempts,
        payload,
    )
