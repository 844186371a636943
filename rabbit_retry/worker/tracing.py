"""The worker's spans (needs OpenTelemetry; README, "Traces"): one CONSUMER span per delivery,
``process Q``, from its arrival to its settlement, ending with what became of it.

The session knows nothing of spans. When the process traces (``rabbit_retry.tracing.active``,
decided once as the runner starts), each delivery's coroutine is wrapped (``around``): the span
starts with the producer's context as parent and a link to the span that published the copy
(``carry``), is current while the handler runs (the handler's own spans are its children), and
ends when the delivery is settled. ``decided`` (the session's one call, as it carries out the
action) names the outcome and stamps the copy about to be published. Without tracing the
session runs its coroutine as it is: no wrapper, no call.

Only a park sets the span's status to ERROR: a retried attempt records its exception as an
event and ends unset, so a trace whose message recovered is not an errored trace, and tail
sampling on errors keeps the stories that ended parked.

Outcomes (``rabbit_retry.outcome``): ``success``, ``retried``, ``parked``; ``duplicate`` (an
``Idempotency`` key already done: acked unhandled), ``returned`` (sent back to its queue
unchanged: a paused queue, a stop, a classic queue's return), ``unsettled`` (the channel closed
first: the broker delivers it again).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, MutableMapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, format_trace_id

from rabbit_retry.topology import naming
from rabbit_retry.tracing import NAME, carry
from rabbit_retry.worker.decide import ACK, Action, NativeRetry, Park, Requeue, TierRetry
from rabbit_retry.worker.history import History, by_our_route

if TYPE_CHECKING:
    from aiormq.abc import DeliveredMessage

    from rabbit_retry.worker.copies import Failure
    from rabbit_retry.worker.session import Stream

    # Session._deliver(stream, message, probe=False)
    Deliver = Callable[..., Coroutine[Any, Any, None]]

# The attributes rabbit-retry adds to the messaging conventions' (README, "Traces").
ATTEMPT = "rabbit_retry.attempt"
OUTCOME = "rabbit_retry.outcome"
TIER = "rabbit_retry.tier"
PARKED_REASON = "rabbit_retry.parked_reason"
RETURNS = "rabbit_retry.returns"
ACQUIRED = "rabbit_retry.acquired_count"
DESTINATION = "messaging.destination.name"
ROUTING_KEY = "messaging.rabbitmq.destination.routing_key"


class _Attempt:
    """One delivery's span, and what the session said of it."""

    __slots__ = ("decided", "had_context", "span")

    def __init__(self, span: Span, had_context: bool) -> None:
        self.span = span
        self.had_context = had_context
        self.decided = False


# The delivery's own, set in its task: a handler that leaves a context of its own attached
# cannot make the session describe another span.
_attempt: ContextVar[_Attempt | None] = ContextVar("rabbit_retry_attempt", default=None)


class Tracing:
    """The worker's tracer, from the global provider."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer(NAME)

    def around(self, deliver: Deliver) -> Deliver:
        """``deliver`` (the session's coroutine for one delivery) inside its span.

        The conventions' required attributes and ours, no more: the SDK spends about as much on
        each attribute as on the span itself (bench/worker_overhead.py)."""
        tracer = self.tracer

        async def traced(stream: Stream, message: DeliveredMessage, probe: bool = False) -> None:
            queue = stream.sub.queue
            props = message.header.properties
            headers = props.headers
            frame = message.delivery
            exchange: str = frame.exchange or ""  # type: ignore[union-attr]
            routing_key: str = frame.routing_key or ""  # type: ignore[union-attr]
            parent, had_context = carry.producer(headers)
            links = None
            if headers and by_our_route(exchange, routing_key, queue):  # else a publisher's
                previous = carry.copied_by(headers)
                if previous is not None:
                    links = [Link(previous)]
            attributes: dict[str, Any] = {
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.subscription.name": queue,
                DESTINATION: exchange,
                "messaging.rabbitmq.message.delivery_tag": frame.delivery_tag,  # type: ignore[union-attr]
            }
            if routing_key:
                attributes[ROUTING_KEY] = routing_key
            if props.message_id:
                attributes["messaging.message.id"] = props.message_id
            if props.correlation_id:
                attributes["messaging.message.conversation_id"] = props.correlation_id
            span = tracer.start_span(f"process {queue}", parent, SpanKind.CONSUMER, attributes,
                                     links)
            attempt = _Attempt(span, had_context)
            token = otel_context.attach(trace.set_span_in_context(span, parent))
            mine = _attempt.set(attempt)
            try:
                await deliver(stream, message, probe)
            finally:
                _attempt.reset(mine)
                otel_context.detach(token)
                if not attempt.decided:
                    span.set_attribute(OUTCOME, "unsettled")
                span.end()

        return traced

    @staticmethod
    def decided(
        queue: str,
        history: History,
        action: Action,
        error: BaseException | None,
        failure: Failure | None,
        headers: MutableMapping[str, Any] | None,
        duplicate: bool = False,
    ) -> None:
        """The session carries out ``action``: say so on the delivery's span, and stamp the
        ``headers`` of the copy it is about to publish (None: it publishes none)."""
        attempt = _attempt.get()
        if attempt is None:  # not a traced delivery's task
            return
        attempt.decided = True
        span = attempt.span
        if headers is not None:
            carry.stamp(headers, span, had_context=attempt.had_context)
        if not span.is_recording():
            return
        attributes: dict[str, Any] = {ATTEMPT: history.failures + 1}
        if history.source is not None:  # where it was first published, as Delivery says
            attributes[DESTINATION], attributes[ROUTING_KEY] = history.source
        if history.returns:
            attributes[RETURNS] = history.returns
        if history.acquired:
            attributes[ACQUIRED] = history.acquired
        if action is ACK:
            attributes[OUTCOME] = "duplicate" if duplicate else "success"
        elif isinstance(action, NativeRetry | TierRetry):
            attributes[OUTCOME] = "retried"
            attributes[TIER] = naming.tier_queue(queue, action.delay_ms)
        elif isinstance(action, Park):
            attributes[OUTCOME] = "parked"
            attributes[PARKED_REASON] = action.reason.value
            attributes["error.type"] = failure.type if failure is not None else action.reason.value
        elif isinstance(action, Requeue):
            attributes[OUTCOME] = "returned"
        span.set_attributes(attributes)
        if error is not None:
            span.record_exception(error)
        elif failure is not None:  # parked without a handler call: what stood in for one
            span.add_event("exception", {"exception.type": failure.type,
                                         "exception.message": failure.message})
        if isinstance(action, Park):
            span.set_status(Status(StatusCode.ERROR, f"parked {action.reason.value}"))


def trace_id() -> str | None:
    """The trace id of the delivery whose task this is, when its span is sampled: the exemplar
    the handler-duration histogram keeps (``metrics.Durations``)."""
    attempt = _attempt.get()
    if attempt is None:
        return None
    context = attempt.span.get_span_context()
    return format_trace_id(context.trace_id) if context.trace_flags.sampled else None
