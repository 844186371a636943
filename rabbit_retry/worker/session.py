"""One connection's worth of consuming: deliveries in, decisions carried out, acks out.

Per delivery: count the failures so far (``attempts``), park it at once if no attempt is left,
validate the body against the consumer's model, claim its idempotency key (``idempotency``),
run the handler under its timeout, decide (``decide``) and carry the decision out: ack,
``nack``, or publish a copy (``copies``) through the confirming ``Publisher`` and ack only once
the copy is confirmed. Every ack goes to the channel the delivery came on. When the connection
or a consuming channel is lost, ``lost`` resolves and whatever is still in flight is dropped:
the broker has it back already.

A consumer's ``Pause`` (``pause``) is carried out here too: its ``Breaker`` says when to pause
and resume the queue's ``Lane``; while paused, a probe takes one message every
``probe_every`` seconds with ``basic.get``, and a watched failure sends its message back to the
queue as a confirmed copy with its count unchanged (a ``nack`` with requeue would be counted
as a return by 3.x and 4.0-4.2 quorum queues, and marks the message redelivered).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import aiormq.exceptions
from aiormq import spec
from aiormq.abc import AbstractConnection, DeliveredMessage

from rabbit_retry.contract import new_message_id, republish_properties
from rabbit_retry.settings import mask
from rabbit_retry.topology.resolved import QueueConfig
from rabbit_retry.worker.attempts import failures_so_far, original_source
from rabbit_retry.worker.consumer import (
    NOT_DECODED,
    Delivery,
    RetryConsumer,
    payload_error,
)
from rabbit_retry.worker.deadlines import Deadlines
from rabbit_retry.worker.decide import (
    Ack,
    Action,
    NativeRetry,
    Outcome,
    Park,
    ParkReason,
    TierRetry,
    before_handler,
    classify,
    decide,
)
from rabbit_retry.worker.lane import Lane
from rabbit_retry.worker.metrics import QueueMetrics
from rabbit_retry.worker.pause import Breaker, Change
from rabbit_retry.worker.publisher import DeliveryGone, Publisher
from rabbit_retry.worker.redelivery import (
    at_delivery_limit,
    counting,
    delivery_limit,
    native_ok,
    with_policy_limit,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from pydantic import TypeAdapter

    from rabbit_retry.worker.copies import Failure
    from rabbit_retry.worker.dedupe import Deduper, Ticket

log = logging.getLogger("rabbit_retry.worker")

CANCEL_TIMEOUT = 5.0

_NO_HEADERS: MappingProxyType[str, Any] = MappingProxyType({})


def _digest(body: bytes) -> str:
    """Tells messages without a message_id apart, for a Pause's count."""
    import hashlib  # only a Pause's failures need it

    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclass(frozen=True)
class Subscription:
    """A consumer with its queue's configuration, model adapter, metrics and copy targets."""

    consumer: RetryConsumer[Any]
    config: QueueConfig
    adapter: TypeAdapter[Any] | None
    metrics: QueueMetrics
    retry_exchange: str
    parking_queue: str
    # Blocking ``def handle`` runs here (``prefetch`` threads); None for ``async def``.
    threads: ThreadPoolExecutor | None = None
    breaker: Breaker | None = None  # the consumer's Pause; lives as long as the runner
    deduper: Deduper | None = None  # the consumer's Idempotency, once its store is open
    deadlines: Deadlines = field(default_factory=Deadlines)  # its handlers' timeouts

    @property
    def queue(self) -> str:
        return self.config.name


class Session:
    """Everything that lives and dies with one connection."""

    def __init__(
        self, connection: AbstractConnection, subscriptions: Sequence[Subscription], user: str
    ) -> None:
        self.amqp = connection
        self.subscriptions = subscriptions
        self.user = user
        self.frame_max = int(self.amqp.connection_tune.frame_max or 131072)
        self.publisher = Publisher(self.amqp)
        self.lanes: list[Lane] = []
        self._lane_of: dict[int, Lane] = {}  # id(subscription) -> its lane
        self._probes: dict[int, asyncio.Task[None]] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._debug = log.isEnabledFor(logging.DEBUG)
        self.amqp.closing.add_done_callback(lambda f: self._set_lost("the connection closed", f))
        self.counting = counting((self.amqp.server_properties or {}).get("version"))
        self.delivery_limits = {
            sub.queue: delivery_limit(
                sub.config.queue_type,
                with_policy_limit(sub.config.arguments, sub.config.policy),
                self.counting,
            )
            for sub in subscriptions
        }

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
        for sub in self.subscriptions:
            channel = await self.amqp.channel(publisher_confirms=False)
            channel.closing.add_done_callback(self._on_channel_closed(sub.queue))

            async def cancelled(_frame: Any, q: str = sub.queue) -> None:
                self._set_lost(f"the broker cancelled the consumer of {q!r}")

            channel.on_consumer_cancel_callbacks.add(cancelled)
            lane = Lane(
                channel,
                sub.queue,
                sub.config.queue_type,
                sub.consumer.prefetch,
                partial(self._deliver, sub),
                self._set_lost,
            )
            paused = sub.breaker is not None and sub.breaker.paused
            await lane.start(paused=paused)
            self.lanes.append(lane)
            self._lane_of[id(sub)] = lane
            if paused:
                log.info("queue=%s stays paused; probing", sub.queue,
                         extra={"queue": sub.queue, "event": "paused"})
                self._start_probe(sub, lane)
                continue
            log.info(
                "consuming queue=%s consumer=%s prefetch=%d",
                sub.queue,
                sub.consumer.name,
                sub.consumer.prefetch,
                extra={"queue": sub.queue, "event": "consuming"},
            )

    def _on_channel_closed(self, queue: str) -> Callable[[asyncio.Future[Any]], None]:
        def closed(future: asyncio.Future[Any]) -> None:
            self._set_lost(f"the consuming channel of {queue!r} closed", future)

        return closed

    async def _deliver(
        self, sub: Subscription, lane: Lane | None, message: DeliveredMessage
    ) -> None:
        """A delivery's task, from ``lane``'s consumer (None: a probe's ``basic.get``): its
        turn on the lane, then ``_handle``; tracked for shutdown, counted in flight, and our own
        failures logged rather than raised into aiormq. One coroutine for all of it: this is
        most of the traffic, and each level of calls costs."""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        metrics = sub.metrics
        metrics.in_flight += 1
        try:
            if lane is not None and not lane.enter(task, message):
                turn = await lane.turn(task, message)
                if turn == "hold":
                    await self._hold(sub, message)
                    return
                if turn == "stopped":  # it goes back to the broker unstarted
                    return
            await self._handle(sub, lane, task, message)
        except DeliveryGone:
            log.debug("queue=%s: delivery dropped, its channel closed", sub.queue)
        except aiormq.exceptions.ChannelInvalidStateError:
            log.debug("queue=%s: could not settle a delivery, its channel closed", sub.queue)
        except Exception:
            # A bug of ours, not the handler's: the delivery stays unacked (and goes back
            # to the broker with the channel) rather than being guessed at.
            log.exception(
                "queue=%s message_id=%s: internal error, message left unacked",
                sub.queue,
                message.header.properties.message_id,
            )
        finally:
            if lane is not None:
                lane.left(task)
            metrics.in_flight -= 1
            self.tasks.discard(task)

    async def _handle(
        self, sub: Subscription, lane: Lane | None, task: asyncio.Task[Any],
        message: DeliveredMessage,
    ) -> None:
        """Count, check, run the handler, decide; the decision is carried out by ``_carry_out``
        (the success path here: it is most of the traffic)."""
        # Consumers only get deliveries. (Annotations, not ``cast`` calls: each call costs.)
        deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
        props = message.header.properties
        headers = props.headers
        queue = sub.queue
        policy = sub.config.retry
        failures = 0
        # A first delivery (no headers, not redelivered) has no failure or return to count:
        # nothing below could park it (max_attempts >= 1), so it skips the checks.
        if headers or deliver.redelivered:
            failures = failures_so_far(headers, queue) if headers else 0
            early = before_handler(failures, policy)
            if early is not None:
                await self._carry_out(sub, lane, task, message, early, failures, None)
                return
            limit = self.delivery_limits[queue]
            if at_delivery_limit(headers, bool(deliver.redelivered), limit):
                # One more return and the broker would dead-letter it into a cycle it refuses
                # (see redelivery.py): the worker counts the returns as one failure and routes
                # it itself.
                assert limit is not None
                action = self._decide(sub, Outcome.FAILED, failures, headers)
                from rabbit_retry.worker import copies  # the failure paths load it

                failure = copies.delivery_limit_failure(queue, limit)
                await self._carry_out(sub, lane, task, message, action, failures, failure)
                return

        payload: Any = NOT_DECODED
        if sub.adapter is not None:
            from pydantic import ValidationError  # loaded already: the adapter is pydantic's

            try:
                payload = sub.adapter.validate_json(message.body)
            except ValidationError as exc:
                from rabbit_retry.worker.copies import Failure

                park = Park(ParkReason.INVALID, failures)
                await self._carry_out(sub, lane, task, message, park, failures,
                                      Failure.from_exception(exc))
                return

        exchange = deliver.exchange or ""
        routing_key = deliver.routing_key or ""
        if headers:  # a retried message: where it was first published, not the retry hop
            exchange, routing_key = original_source(headers, queue, exchange, routing_key)
        delivery: Delivery[Any] = Delivery(
            message.body,
            MappingProxyType(headers) if headers else _NO_HEADERS,
            props.message_id,
            props.correlation_id,
            routing_key,
            exchange,
            queue,
            failures + 1,  # attempt
            policy.max_attempts,
            payload,
        )
        timeout = sub.consumer.handler_timeout
        ticket: Ticket | None = None
        if sub.deduper is not None:
            ticket = await sub.deduper.admit(delivery, lambda: not message.channel.is_closed)
            if ticket.gone:
                return
            if ticket.duplicate:
                await message.channel.basic_ack(deliver.delivery_tag)  # type: ignore[arg-type]
                sub.metrics.duplicates += 1
                if self._debug:
                    self._log_decision(sub, props.message_id, failures, "duplicate")
                return
        started = time.perf_counter()
        if timeout is not None:
            # The consumer's ``Deadlines`` (one timer for all its deliveries) rather than
            # ``asyncio.timeout`` or a timer per delivery: a fraction of the cost. The
            # cancellation can only land while the handler is suspended, and the deadline is
            # dropped (``ended``) before anything else of ours awaits: it never hits our ack.
            sub.deadlines.start(task, timeout)
        try:
            result = await self._call(sub, delivery)
            if result is not None and inspect.isawaitable(result):
                # A handler that handed back its work (a decorator's wrapper, a plain def
                # returning a coroutine) has not run it yet: run it, under the same timeout.
                await result
        except BaseException as exc:
            what = exc if timeout is None else sub.deadlines.ended(task, exc, timeout)
            if not isinstance(what, Exception):  # a cancellation (shutdown), an exit
                raise
            sub.metrics.handler_seconds.observe(time.perf_counter() - started)
            await self._failed(sub, lane, task, message, delivery, ticket, failures, what)
            return
        if timeout is not None:
            sub.deadlines.ended(task, None, timeout)
        sub.metrics.handler_seconds.observe(time.perf_counter() - started)
        if lane is not None:
            lane.ran(task)
        # Told to the breaker as the handler returns, in the order of the failures it counts
        # (not after the ack, when failures that came later may have been counted already).
        resumed = sub.breaker is not None and sub.breaker.succeeded() is Change.RESUMED
        if ticket is not None:  # done before the ack: a redelivery is then a duplicate
            await self._deduper(sub).succeeded(ticket, lambda: not message.channel.is_closed)
        await message.channel.basic_ack(deliver.delivery_tag)  # type: ignore[arg-type]
        sub.metrics.success += 1
        if self._debug:
            self._log_decision(sub, props.message_id, failures, "success")
        if resumed:
            await self._resume(sub)

    async def _failed(
        self,
        sub: Subscription,
        lane: Lane | None,
        task: asyncio.Task[Any],
        message: DeliveredMessage,
        delivery: Delivery[Any],
        ticket: Ticket | None,
        failures: int,
        exc: Exception,
    ) -> None:
        """The handler raised ``exc``: classify, tell the breaker and the deduper, decide."""
        invalid = payload_error(delivery)
        outcome = classify(
            exc,
            payload_invalid=invalid is not None,
            permanent_errors=sub.consumer.permanent_errors,
        )
        from rabbit_retry.worker.copies import Failure  # loaded by the first failure

        failure = Failure.from_exception(invalid or exc)
        # The breaker hears of it before anything of ours awaits (see the success path).
        breaker = sub.breaker
        uncharged = paused = False
        if outcome is Outcome.FAILED and breaker is not None and breaker.rule.watches(exc):
            uncharged = breaker.paused  # the queue is paused: this one is not charged
            if not uncharged:
                props = message.header.properties
                change = breaker.failed(props.message_id or _digest(message.body))
                paused = change is Change.PAUSED
        if ticket is not None:
            await self._deduper(sub).failed(ticket, lambda: not message.channel.is_closed)
        if uncharged:
            if lane is not None:
                lane.ran(task)
            await self._return_unchanged(sub, message, failures)
            return
        if paused:
            await self._pause(sub, failure)
        action = self._decide(sub, outcome, failures, message.header.properties.headers)
        await self._carry_out(sub, lane, task, message, action, failures, failure)

    @staticmethod
    def _deduper(sub: Subscription) -> Deduper:
        assert sub.deduper is not None, "a ticket comes from the deduper"
        return sub.deduper

    async def _hold(self, sub: Subscription, message: DeliveredMessage) -> None:
        """A delivery that reached a paused lane before it started: back to the queue."""
        headers = message.header.properties.headers
        await self._return_unchanged(
            sub, message, failures_so_far(headers, sub.queue) if headers else 0
        )

    async def _return_unchanged(
        self, sub: Subscription, message: DeliveredMessage, failures: int
    ) -> None:
        """Back to the end of the queue as a confirmed copy that counts no failure more."""
        from rabbit_retry.worker import copies

        props = message.header.properties
        headers = copies.retry_headers(
            props.headers,
            retry_count=failures,
            original=self._original(sub, message),
            expiration=props.expiration,
        )
        await self._publish_then_ack(sub, message, "", sub.queue, headers, failures)

    async def _pause(self, sub: Subscription, failure: Failure) -> None:
        breaker = sub.breaker
        assert breaker is not None
        breaker.since = time.monotonic()
        sub.metrics.paused = 1
        sub.metrics.pauses += 1
        log.warning(
            "paused queue=%s consumer=%s after %d failures in a row of different messages"
            " (last: %s); probing every %gs",
            sub.queue,
            sub.consumer.name,
            breaker.rule.after,
            failure.type,
            breaker.rule.probe_every,
            extra={"queue": sub.queue, "event": "paused"},
        )
        lane = self._lane_of[id(sub)]
        await lane.pause()
        self._start_probe(sub, lane)

    async def _resume(self, sub: Subscription) -> None:
        breaker = sub.breaker
        assert breaker is not None
        sub.metrics.paused = 0
        log.warning(
            "resumed queue=%s consumer=%s after %.1fs paused: a message succeeded",
            sub.queue,
            sub.consumer.name,
            time.monotonic() - breaker.since,
            extra={"queue": sub.queue, "event": "resumed"},
        )
        lane = self._lane_of.get(id(sub))
        if lane is not None:
            await lane.resume()

    def _start_probe(self, sub: Subscription, lane: Lane) -> None:
        running = self._probes.get(id(sub))
        if running is None or running.done():
            self._probes[id(sub)] = asyncio.create_task(self._probe(sub, lane))

    async def _probe(self, sub: Subscription, lane: Lane) -> None:
        """While paused: every ``probe_every`` seconds, once nothing of the lane runs, take one
        message with ``basic.get`` and handle it; its success resumes the lane."""
        breaker = sub.breaker
        assert breaker is not None
        try:
            while breaker.paused and not self.lost.done():
                await asyncio.sleep(breaker.rule.probe_every)
                await lane.idle()
                if not breaker.paused or self.lost.done():
                    return
                message = await lane.channel.basic_get(sub.queue, no_ack=False)
                if isinstance(message.delivery, spec.Basic.GetOk):
                    log.info("queue=%s: probing with message_id=%s", sub.queue,
                             message.header.properties.message_id,
                             extra={"queue": sub.queue, "event": "probe"})
                    await self._deliver(sub, None, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel died: the session reconnects, still paused
            self._set_lost(f"probing {sub.queue!r} failed: {exc!r}")

    def _decide(
        self, sub: Subscription, outcome: Outcome, failures: int, headers: Mapping[str, Any] | None
    ) -> Action:
        native = native_ok(headers, self.counting)
        return decide(outcome, failures, sub.config.retry, sub.config.queue_type, native_ok=native)

    @staticmethod
    def _call(sub: Subscription, delivery: Delivery[Any]) -> Awaitable[Any]:
        """The handler's awaitable: the coroutine itself, or its run in the thread pool."""
        if sub.threads is None:
            return sub.consumer.handle(delivery)  # type: ignore[return-value]  # async def
        return asyncio.get_running_loop().run_in_executor(
            sub.threads, sub.consumer.handle, delivery
        )

    async def _carry_out(
        self,
        sub: Subscription,
        lane: Lane | None,
        task: asyncio.Task[Any],
        message: DeliveredMessage,
        action: Action,
        failures: int,
        failure: Failure | None,
    ) -> None:
        """Ack, nack, or publish a confirmed copy and then ack: ``action`` says which."""
        if lane is not None:
            lane.ran(task)  # no user code runs from here on
        from rabbit_retry.worker import copies

        channel = message.channel
        tag = cast(int, cast(spec.Basic.Deliver, message.delivery).delivery_tag)
        if isinstance(action, Ack):
            await channel.basic_ack(tag)
            sub.metrics.success += 1
        elif isinstance(action, NativeRetry):
            await channel.basic_nack(tag, requeue=False)
            sub.metrics.retried += 1
            self._log_retry(sub, message, failures, action.retry_count, action.delay_ms,
                            "native", failure)
        elif isinstance(action, TierRetry):
            headers = copies.retry_headers(
                message.header.properties.headers,
                retry_count=action.retry_count,
                original=self._original(sub, message),
                expiration=message.header.properties.expiration,
            )
            await self._publish_then_ack(sub, message, sub.retry_exchange, action.tier, headers,
                                         failures)
            sub.metrics.retried += 1
            self._log_retry(sub, message, failures, action.retry_count, action.delay_ms,
                            action.tier, failure)
        else:
            headers = copies.parked_headers(
                message.header.properties.headers,
                reason=action.reason.value,
                retry_count=action.retry_count,
                queue=sub.queue,
                original=self._original(sub, message),
                failure=failure,
                now=datetime.now(UTC),
                parked_id=new_message_id(),
                expiration=message.header.properties.expiration,
                frame_max=self.frame_max,
            )
            await self._publish_then_ack(sub, message, "", sub.parking_queue, headers, failures)
            sub.metrics.parked += 1
            sub.metrics.parked_by_reason[action.reason.value] += 1
            self._log_park(sub, message, failures, action, failure)

    @staticmethod
    def _original(sub: Subscription, message: DeliveredMessage) -> tuple[str, str]:
        deliver = cast(spec.Basic.Deliver, message.delivery)
        return original_source(
            message.header.properties.headers,
            sub.queue,
            deliver.exchange or "",
            deliver.routing_key or "",
        )

    async def _publish_then_ack(
        self,
        sub: Subscription,
        message: DeliveredMessage,
        exchange: str,
        routing_key: str,
        headers: dict[str, Any],
        failures: int,
    ) -> None:
        """The copy, confirmed (retried with backoff while the delivery lives), then the ack."""
        channel = message.channel
        props = message.header.properties
        await self.publisher.publish_held(
            exchange,
            routing_key,
            message.body,
            republish_properties(props, headers, self.user, expiration=None),
            delivery_alive=lambda: not channel.is_closed,
            context={"queue": sub.queue, "message_id": props.message_id, "attempt": failures + 1},
        )
        await channel.basic_ack(cast(int, cast(spec.Basic.Deliver, message.delivery).delivery_tag))

    @staticmethod
    def _log_decision(
        sub: Subscription, message_id: str | None, failures: int, outcome: str
    ) -> None:
        log.debug(
            "decision queue=%s message_id=%s attempt=%d outcome=%s",
            sub.queue,
            message_id,
            failures + 1,
            outcome,
            extra={"queue": sub.queue, "message_id": message_id, "attempt": failures + 1,
                   "outcome": outcome},
        )

    @staticmethod
    def _log_retry(
        sub: Subscription,
        message: DeliveredMessage,
        failures: int,
        retry_count: int,
        delay_ms: int,
        via: str,
        failure: Failure | None,
    ) -> None:
        message_id = message.header.properties.message_id
        log.info(
            "decision queue=%s message_id=%s attempt=%d outcome=retried retry_count=%d"
            " delay_ms=%d via=%s error=%s",
            sub.queue,
            message_id,
            failures + 1,
            retry_count,
            delay_ms,
            via,
            failure.type if failure else "-",
            extra={"queue": sub.queue, "message_id": message_id, "attempt": failures + 1,
                   "outcome": "retried", "delay_ms": delay_ms},
        )

    @staticmethod
    def _log_park(
        sub: Subscription,
        message: DeliveredMessage,
        failures: int,
        action: Park,
        failure: Failure | None,
    ) -> None:
        message_id = message.header.properties.message_id
        log.warning(
            "decision queue=%s message_id=%s attempt=%d outcome=parked reason=%s"
            " retry_count=%d error=%s",
            sub.queue,
            message_id,
            failures + 1,
            action.reason.value,
            action.retry_count,
            failure.type if failure else "-",
            extra={"queue": sub.queue, "message_id": message_id, "attempt": failures + 1,
                   "outcome": "parked", "reason": action.reason.value},
        )

    async def shutdown(self, grace: float, force: asyncio.Event) -> None:
        """Stop new deliveries, give in-flight ones ``grace`` seconds, then close."""
        await self._stop_probes()
        for lane in self.lanes:
            await lane.stop(CANCEL_TIMEOUT)
        await asyncio.sleep(0)  # deliveries still waiting for their turn leave, unstarted
        pending = {t for t in self.tasks if not t.done()}
        if pending:
            log.info("stopping: waiting up to %gs for %d in-flight message(s)", grace, len(pending))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            forced: asyncio.Future[Any] = asyncio.ensure_future(force.wait())
            try:
                while not forced.done():
                    pending = {t for t in pending if not t.done()}
                    left = deadline - loop.time()
                    if not pending or left <= 0:
                        break
                    await asyncio.wait(
                        {*pending, forced}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                    )
            finally:
                forced.cancel()
            unfinished = [t for t in pending if not t.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.wait(unfinished, timeout=CANCEL_TIMEOUT)
                log.warning(
                    "stopping: %d message(s) did not finish within the grace period; they were"
                    " not acked and go back to the broker",
                    len(unfinished),
                )
        await self.close()

    async def _stop_probes(self) -> None:
        probes = [t for t in self._probes.values() if not t.done()]
        for task in probes:
            task.cancel()
        if probes:
            await asyncio.wait(probes, timeout=CANCEL_TIMEOUT)

    async def close(self) -> None:
        """Close the connection and drop whatever is still in flight: the broker requeues
        every unacked delivery of a closed channel, so finishing them here would only ack on a
        dead channel or race their redelivery."""
        await self._stop_probes()
        stale = [t for t in self.tasks if not t.done()]
        for task in stale:
            task.cancel()
        if stale:
            # A handler that swallows cancellation must not hold the runner forever.
            await asyncio.wait(stale, timeout=CANCEL_TIMEOUT)
            log.info("dropped %d in-flight delivery(ies); the broker redelivers them", len(stale))
        await self.publisher.close()
        with suppress(Exception):
            # As aio-pika closes it, so that a closing connection reads as closed on purpose.
            await self.amqp.close(aiormq.exceptions.ConnectionClosed)
