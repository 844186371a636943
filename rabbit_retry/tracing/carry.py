"""Trace contexts carried in a message's AMQP headers (needs OpenTelemetry).

Two contexts travel with a message:

- the producer's, written by whoever published it, in the headers its propagator uses (the
  global propagator reads them: W3C ``traceparent`` / ``tracestate`` unless configured
  otherwise). Every attempt's span is its child: one message, one trace. Copies keep it as
  they keep every header; a copy of a message that carried none gets the context of the span
  that made it, so that what follows joins that span's trace instead of starting trace after
  trace.
- ``copy-span`` (``contract.COPY_SPAN``), rabbit-retry's own: the span that published this copy
  (the attempt that retried or parked it, the operator's replay), always in W3C ``traceparent``
  form whatever the propagator. The next attempt's span links to it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rabbit_retry.contract import COPY_SPAN, as_text

_W3C = TraceContextTextMapPropagator()


class _Headers(Getter[Mapping[str, Any]]):
    """Reads AMQP headers for a propagator: a value is text or UTF-8 bytes (a client may send
    either), anything else is absent."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = as_text(carrier.get(key))
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [key for key in carrier if isinstance(key, str)]


HEADERS = _Headers()


def producer(headers: Mapping[str, Any] | None) -> tuple[Context, bool]:
    """The context the message was published under (the global propagator's reading of its
    headers), and whether it names a span; a fresh context when it carries none."""
    if not headers:
        return Context(), False
    try:
        context = propagate.extract(headers, Context(), getter=HEADERS)
    except Exception:  # a propagator that trips over a client's header must not stop a message
        return Context(), False
    return context, trace.get_current_span(context).get_span_context().is_valid


def copied_by(headers: Mapping[str, Any] | None) -> SpanContext | None:
    """The span that published this copy (``copy-span``), when the headers name a valid one."""
    value = as_text(headers.get(COPY_SPAN)) if headers else None
    if value is None:
        return None
    context = _W3C.extract({"traceparent": value})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def stamp(headers: MutableMapping[str, Any], span: Span, *, had_context: bool) -> None:
    """Mark a copy as published by ``span``: ``copy-span``, and where the message carried no
    producer context (``had_context`` False), ``span``'s context in the propagator's headers."""
    context = trace.set_span_in_context(span, Context())
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context)
    if "traceparent" in carrier:  # absent for an invalid span: nothing to link to
        headers[COPY_SPAN] = carrier["traceparent"]
    if not had_context:
        propagate.inject(headers, context)
