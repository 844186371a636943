"""One connection's worth of consuming: deliveries in, decisions carried out, acks out.

Per delivery: count the failures so far (``attempts``), park it at once if no attempt is left,
validate the body against the consumer's model, run the handler under its timeout, decide
(``decide``) and carry the decision out: ack, ``nack``, or publish a copy (``copies``) through
the confirming ``Publisher`` and ack only once the copy is confirmed. Every ack goes to the
channel the delivery came on. When the connection or a consuming channel is lost, ``lost``
resolves and whatever is still in flight is dropped: the broker has it back already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, cast

import aiormq.exceptions
from aio_pika.abc import AbstractConnection as AioPikaConnection
from aiormq import spec
from aiormq.abc import AbstractConnection, DeliveredMessage
from pydantic import TypeAdapter, ValidationError

from rabbit_retry.contract import republish_properties
from rabbit_retry.settings import mask
from rabbit_retry.topology.model import QueueConfig
from rabbit_retry.worker import copies
from rabbit_retry.worker.attempts import failures_so_far, original_source
from rabbit_retry.worker.consumer import (
    _UNSET,
    Delivery,
    HandlerTimeout,
    Permanent,
    RetryConsumer,
)
from rabbit_retry.worker.decide import (
    Ack,
    NativeRetry,
    Outcome,
    Park,
    ParkReason,
    TierRetry,
    before_handler,
    decide,
)
from rabbit_retry.worker.lane import Lane
from rabbit_retry.worker.metrics import QueueMetrics
from rabbit_retry.worker.publisher import DeliveryGone, Publisher
from rabbit_retry.worker.redelivery import at_delivery_limit, counting, delivery_limit, native_ok

log = logging.getLogger("rabbit_retry.worker")

CANCEL_TIMEOUT = 5.0

_NO_HEADERS: MappingProxyType[str, Any] = MappingProxyType({})


def _expire(task: asyncio.Task[Any], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()


DELIVERY_LIMIT_FAILURE = "rabbit_retry.worker.DeliveryLimitReached"


@dataclass(frozen=True)
class Bound:
    """A consumer bound to its queue's configuration and metrics."""

    consumer: RetryConsumer
    config: QueueConfig
    adapter: TypeAdapter[Any] | None
    metrics: QueueMetrics
    retry_exchange: str
    parking_queue: str

    @property
    def queue(self) -> str:
        return self.config.name


class Session:
    """Everything that lives and dies with one connection."""

    def __init__(self, connection: AioPikaConnection, bound: Sequence[Bound], user: str) -> None:
        self.connection = connection
        transport = connection.transport
        assert transport is not None, "connected"
        self.amqp: AbstractConnection = transport.connection
        self.bound = bound
        self.user = user
        self.frame_max = int(self.amqp.connection_tune.frame_max or 131072)
        self.publisher = Publisher(self.amqp)
        self.lanes: list[Lane] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._debug = log.isEnabledFor(logging.DEBUG)
        self.amqp.closing.add_done_callback(lambda f: self._set_lost("the connection closed", f))
        self.counting = counting((self.amqp.server_properties or {}).get("version"))
        self.delivery_limits = {
            b.queue: delivery_limit(b.config.queue_type, b.config.arguments, self.counting)
            for b in bound
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
        for b in self.bound:
            channel = await self.amqp.channel(publisher_confirms=False)
            channel.closing.add_done_callback(self._on_channel_closed(b.queue))

            async def cancelled(_frame: Any, q: str = b.queue) -> None:
                self._set_lost(f"the broker cancelled the consumer of {q!r}")

            channel.on_consumer_cancel_callbacks.add(cancelled)
            lane = Lane(
                channel,
                b.queue,
                b.config.queue_type,
                b.consumer.prefetch,
                self._callback(b),
                self._set_lost,
            )
            await lane.start()
            self.lanes.append(lane)
            log.info(
                "consuming queue=%s consumer=%s prefetch=%d",
                b.queue,
                b.consumer.name,
                b.consumer.prefetch,
                extra={"queue": b.queue, "event": "consuming"},
            )

    def _on_channel_closed(self, queue: str) -> Callable[[asyncio.Future[Any]], None]:
        def closed(future: asyncio.Future[Any]) -> None:
            self._set_lost(f"the consuming channel of {queue!r} closed", future)

        return closed

    def _callback(self, b: Bound) -> Callable[[DeliveredMessage], Coroutine[Any, Any, None]]:
        async def on_message(message: DeliveredMessage) -> None:
            task = asyncio.current_task()
            assert task is not None
            self.tasks.add(task)
            metrics = b.metrics
            metrics.in_flight += 1
            try:
                await self._handle(b, message)
            except DeliveryGone:
                log.debug("queue=%s: delivery dropped, its channel closed", b.queue)
            except aiormq.exceptions.ChannelInvalidStateError:
                log.debug("queue=%s: could not settle a delivery, its channel closed", b.queue)
            except Exception:
                # A bug of ours, not the handler's: the delivery stays unacked (and goes back
                # to the broker with the channel) rather than being guessed at.
                log.exception(
                    "queue=%s message_id=%s: internal error, message left unacked",
                    b.queue,
                    message.header.properties.message_id,
                )
            finally:
                metrics.in_flight -= 1
                self.tasks.discard(task)

        return on_message

    async def _handle(self, b: Bound, message: DeliveredMessage) -> None:
        deliver = cast(spec.Basic.Deliver, message.delivery)  # consumers only get deliveries
        props = message.header.properties
        headers = props.headers
        policy = b.config.retry
        failures = failures_so_far(headers, b.queue) if headers else 0

        early = before_handler(failures, policy)
        if early is not None:
            await self._carry_out(b, message, deliver, early, failures, None)
            return
        limit = self.delivery_limits[b.queue]
        if at_delivery_limit(headers, bool(deliver.redelivered), limit):
            # One more return and the broker would dead-letter it into a cycle it refuses (see
            # redelivery.py): the worker counts the returns as one failure and routes it itself.
            native = native_ok(headers, self.counting)
            action = decide(Outcome.FAILED, failures, policy, b.config.queue_type, native_ok=native)
            failure = copies.Failure(
                type=DELIVERY_LIMIT_FAILURE,
                message=f"returned to {b.queue!r} {limit} times without a verdict (the worker "
                "crashed, lost its connection or stopped while handling it); counted as one "
                "failed attempt, the handler was not called",
                stacktrace="",
            )
            await self._carry_out(b, message, deliver, action, failures, failure)
            return

        payload: Any = _UNSET
        if b.adapter is not None:
            try:
                payload = b.adapter.validate_json(message.body)
            except ValidationError as exc:
                park = Park(ParkReason.INVALID, failures)
                failure = copies.Failure.from_exception(exc)
                await self._carry_out(b, message, deliver, park, failures, failure)
                return

        exchange = deliver.exchange or ""
        routing_key = deliver.routing_key or ""
        if headers:  # a retried message: where it was first published, not the retry hop
            exchange, routing_key = original_source(headers, b.queue, exchange, routing_key)
        delivery = Delivery(
            body=message.body,
            headers=MappingProxyType(headers) if headers else _NO_HEADERS,
            message_id=props.message_id,
            correlation_id=props.correlation_id,
            routing_key=routing_key,
            exchange=exchange,
            queue=b.queue,
            attempt=failures + 1,
            max_attempts=policy.max_attempts,
            payload=payload,
        )
        consumer = b.consumer
        timeout = consumer.handler_timeout
        started = time.perf_counter()
        try:
            if timeout is None:
                await consumer.handle(delivery)
            else:
                await self._handle_within(consumer, delivery, timeout)
        except Exception as exc:
            b.metrics.handler_seconds.observe(time.perf_counter() - started)
            error: BaseException = exc
            if delivery.invalid is not None:
                outcome = Outcome.INVALID
                error = delivery.invalid
            elif isinstance(exc, HandlerTimeout):
                outcome = Outcome.FAILED  # even if TimeoutError is in permanent_errors
            elif isinstance(exc, (Permanent, *consumer.permanent_errors)):
                outcome = Outcome.PERMANENT
            else:
                outcome = Outcome.FAILED
            native = native_ok(headers, self.counting)
            action = decide(outcome, failures, policy, b.config.queue_type, native_ok=native)
            failure = copies.Failure.from_exception(error)
            await self._carry_out(b, message, deliver, action, failures, failure)
            return
        b.metrics.handler_seconds.observe(time.perf_counter() - started)
        # The success path, kept short: it is most of the traffic.
        await message.channel.basic_ack(cast(int, deliver.delivery_tag))
        b.metrics.success.inc()
        if self._debug:
            log.debug(
                "decision queue=%s message_id=%s attempt=%d outcome=success",
                b.queue,
                props.message_id,
                failures + 1,
                extra={
                    "queue": b.queue,
                    "message_id": props.message_id,
                    "attempt": failures + 1,
                    "outcome": "success",
                },
            )

    @staticmethod
    async def _handle_within(consumer: RetryConsumer, delivery: Delivery, seconds: float) -> None:
        """``consumer.handle``, cancelled after ``seconds`` (``HandlerTimeout``).

        A timer handle rather than ``asyncio.timeout``: half the cost on the success path. The
        timer can only fire while the handler is suspended, and is cancelled before anything
        else of ours awaits, so a late cancellation can never hit our own ack.
        """
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        expired: list[bool] = []
        timer = loop.call_at(loop.time() + seconds, _expire, task, expired)
        try:
            await consumer.handle(delivery)
        except asyncio.CancelledError as exc:
            if expired and task.uncancel() == 0:  # ours alone, not a shutdown as well
                raise HandlerTimeout(
                    f"the handler did not finish within {seconds:g}s"
                ).with_traceback(exc.__traceback__) from None
            raise
        except BaseException:
            if expired:
                task.uncancel()
            raise
        finally:
            timer.cancel()
        if expired:  # it swallowed the cancellation and finished: its result stands
            task.uncancel()

    async def _carry_out(
        self,
        b: Bound,
        message: DeliveredMessage,
        deliver: spec.Basic.Deliver,
        action: Ack | NativeRetry | TierRetry | Park,
        failures: int,
        failure: copies.Failure | None,
    ) -> None:
        channel = message.channel
        tag = cast(int, deliver.delivery_tag)
        props = message.header.properties
        context: dict[str, Any] = {
            "queue": b.queue,
            "message_id": props.message_id,
            "attempt": failures + 1,
        }
        if isinstance(action, Ack):
            await channel.basic_ack(tag)
            b.metrics.success.inc()
            return
        if isinstance(action, NativeRetry):
            await channel.basic_nack(tag, requeue=False)
            b.metrics.retried.inc()
            self._log_retry(context, action.retry_count, action.delay_ms, "native", failure)
            return

        def alive() -> bool:
            return not channel.is_closed

        original = original_source(
            props.headers, b.queue, deliver.exchange or "", deliver.routing_key or ""
        )
        if isinstance(action, TierRetry):
            headers = copies.retry_headers(
                props.headers,
                retry_count=action.retry_count,
                original=original,
                expiration=props.expiration,
            )
            await self.publisher.publish_held(
                b.retry_exchange,
                action.tier,
                message.body,
                self._copy_properties(props, headers),
                delivery_alive=alive,
                context=context,
            )
            await channel.basic_ack(tag)
            b.metrics.retried.inc()
            self._log_retry(context, action.retry_count, action.delay_ms, action.tier, failure)
            return

        headers = copies.parked_headers(
            props.headers,
            reason=action.reason.value,
            retry_count=action.retry_count,
            queue=b.queue,
            original=original,
            failure=failure,
            now=datetime.now(UTC),
            expiration=props.expiration,
            frame_max=self.frame_max,
        )
        await self.publisher.publish_held(
            "",
            b.parking_queue,
            message.body,
            self._copy_properties(props, headers),
            delivery_alive=alive,
            context=context,
        )
        await channel.basic_ack(tag)
        b.metrics.parked.inc()
        b.metrics.parked_by_reason[action.reason.value].inc()
        log.warning(
            "decision queue=%s message_id=%s attempt=%d outcome=parked reason=%s"
            " retry_count=%d error=%s",
            b.queue,
            props.message_id,
            failures + 1,
            action.reason.value,
            action.retry_count,
            failure.type if failure else "-",
            extra={**context, "outcome": "parked", "reason": action.reason.value},
        )

    def _copy_properties(self, props: Any, headers: dict[str, Any]) -> Any:
        return republish_properties(props, headers, self.user, expiration=None)

    @staticmethod
    def _log_retry(
        context: dict[str, Any],
        retry_count: int,
        delay_ms: int,
        via: str,
        failure: copies.Failure | None,
    ) -> None:
        log.info(
            "decision queue=%s message_id=%s attempt=%d outcome=retried retry_count=%d"
            " delay_ms=%d via=%s error=%s",
            context["queue"],
            context["message_id"],
            context["attempt"],
            retry_count,
            delay_ms,
            via,
            failure.type if failure else "-",
            extra={**context, "outcome": "retried", "delay_ms": delay_ms},
        )

    async def shutdown(self, grace: float, force: asyncio.Event) -> None:
        """Stop new deliveries, give in-flight ones ``grace`` seconds, then close."""
        for lane in self.lanes:
            await lane.stop(CANCEL_TIMEOUT)
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

    async def close(self) -> None:
        """Close the connection and drop whatever is still in flight: the broker requeues
        every unacked delivery of a closed channel, so finishing them here would only ack on a
        dead channel or race their redelivery."""
        stale = [t for t in self.tasks if not t.done()]
        for task in stale:
            task.cancel()
        if stale:
            # A handler that swallows cancellation must not hold the runner forever.
            await asyncio.wait(stale, timeout=CANCEL_TIMEOUT)
            log.info("dropped %d in-flight delivery(ies); the broker redelivers them", len(stale))
        await self.publisher.close()
        with suppress(Exception):
            await self.connection.close()
