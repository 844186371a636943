"""The span of an operator's replay (``parking replay``, the desk's replay): one span for the
action, each replayed copy stamped with it (needs OpenTelemetry).

The replayed attempt's span links to the replay (``copy-span``), and stays in its message's
trace (the producer's context, which the parked copy kept). The replay's span links to the
attempt that parked each message it replays, as many as the SDK keeps
(``OTEL_SPAN_LINK_COUNT_LIMIT``, 128 by default): the trace of the operator's action leads to
the stories it resumed, and each story to the action.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from rabbit_retry.tracing import NAME, carry

COUNT = "rabbit_retry.replay.count"


class ReplayTrace:
    """The replay's span, and how many copies the broker confirmed (``replayed``)."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.count = 0

    def copied(self, parked: Mapping[str, Any] | None) -> dict[str, Any]:
        """The headers that stamp the replayed copy of a parked message (whose headers are
        ``parked``) with the replay; the replay links to the attempt that parked it."""
        if self.span.is_recording():
            parked_by = carry.copied_by(parked)
            if parked_by is not None:
                self.span.add_link(parked_by)
        _, had_context = carry.producer(parked)
        headers: dict[str, Any] = {}
        carry.stamp(headers, self.span, had_context=had_context)
        return headers

    def note(self, attributes: Mapping[str, Any]) -> None:
        """More of what the replay is about, once known."""
        self.span.set_attributes(dict(attributes))

    def replayed(self, count: int = 1) -> None:
        """``count`` more copies confirmed by the broker."""
        self.count += count


@contextmanager
def started(name: str, attributes: Mapping[str, Any]) -> Iterator[ReplayTrace]:
    """A PRODUCER span named ``name`` for the block, current while it runs; a failure that
    ends the block is recorded on it (status ERROR)."""
    tracer = trace.get_tracer(NAME)
    kept = {key: value for key, value in attributes.items() if value is not None}
    with tracer.start_as_current_span(
        name, kind=SpanKind.PRODUCER,
        attributes={"messaging.system": "rabbitmq", "messaging.operation.type": "send", **kept},
    ) as span:
        replay = ReplayTrace(span)
        try:
            yield replay
        finally:
            span.set_attribute(COUNT, replay.count)
