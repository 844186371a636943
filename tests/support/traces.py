"""Spans read back in memory (test-only): OpenTelemetry's SDK as the process's global tracer
provider for one test, as an application or ``opentelemetry-instrument`` would set it, and gone
again after it (the SDK's own tests reset the same two globals)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id
from opentelemetry.util._once import Once

# Run first in a child process: its imports of OpenTelemetry fail, as where the extra is not
# installed.
WITHOUT_OTEL = """
import sys
from importlib.abc import MetaPathFinder

class NoOpenTelemetry(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
"""


def _reset() -> None:
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]


@contextlib.contextmanager
def global_provider() -> Iterator[InMemorySpanExporter]:
    """The SDK as the global tracer provider for the block; its finished spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        _reset()


def produced(name: str = "publish order") -> tuple[ReadableSpan, dict[str, str]]:
    """A producer's span, ended, and the headers its publish carries (the global propagator's:
    ``traceparent``, and ``tracestate`` / ``baggage`` when set)."""
    tracer = trace.get_tracer("a producer")
    with tracer.start_as_current_span(name, kind=trace.SpanKind.PRODUCER) as span:
        headers: dict[str, str] = {}
        propagate.inject(headers)
    assert isinstance(span, ReadableSpan)
    return span, headers


def traceparent(span: ReadableSpan) -> str:
    """``span``'s context in W3C form, as ``copy-span`` carries it."""
    context = span.get_span_context()
    assert context is not None
    return (f"00-{format_trace_id(context.trace_id)}-{format_span_id(context.span_id)}-"
            f"{context.trace_flags:02x}")


def attempts(spans: Sequence[ReadableSpan], queue: str) -> list[ReadableSpan]:
    """The worker's spans for ``queue``, in the order they started."""
    return sorted((s for s in spans if s.name == f"process {queue}"),
                  key=lambda s: s.start_time or 0)


def linked(span: ReadableSpan) -> list[int]:
    """The span ids ``span`` links to."""
    return [link.context.span_id for link in span.links]


def span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.span_id


def trace_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan) -> list[tuple[str, dict[str, Any]]]:
    return [(event.name, dict(event.attributes or {})) for event in span.events]
