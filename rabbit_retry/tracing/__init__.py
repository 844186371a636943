"""Traces (``pip install 'rabbit-retry[otel]'``): whether this process traces, decided once.

A rabbit-retry process traces when OpenTelemetry's global tracer provider has been set, by the
application (``trace.set_tracer_provider`` in the consumer module or ``on_start``), by
``opentelemetry-instrument``, or named by ``OTEL_PYTHON_TRACER_PROVIDER``: spans and contexts
then go through the API's global provider and propagator, whatever configured them. Without one
there is nothing to send spans to, and nothing of OpenTelemetry is imported: ``active`` looks at
``sys.modules`` before it imports anything, and ``carry``, ``replay`` and
``rabbit_retry.worker.tracing`` (which import OpenTelemetry) are only imported once it said yes.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from rabbit_retry.errors import InputError

if TYPE_CHECKING:
    from rabbit_retry.tracing.replay import ReplayTrace

NAME = "rabbit_retry"  # the instrumentation scope every span is made under
INSTALL = "pip install 'rabbit-retry[otel]'"


def active(setting: bool | None = None) -> bool:
    """Whether to trace: ``setting`` when given (True without OpenTelemetry installed is an
    ``InputError``), else whether a global tracer provider is set (see the module docstring)."""
    if setting is False:
        return False
    if setting is None and "opentelemetry.trace" not in sys.modules and (
            "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ):
        return False  # nothing imported OpenTelemetry, so nothing configured it
    try:
        from opentelemetry import trace
    except ImportError:
        if setting:
            raise InputError(f"tracing needs OpenTelemetry: {INSTALL}") from None
        return False
    if setting:
        return True
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def replay_span(
    name: str, attributes: dict[str, Any], setting: bool | None = None
) -> AbstractContextManager[ReplayTrace | None]:
    """The span of an operator's replay (CLI or desk) when this process traces, else a block
    that yields None: ``with replay_span(...) as trace: ... if trace: trace.copied(...)``."""
    if not active(setting):
        return nullcontext(None)
    from rabbit_retry.tracing.replay import started

    return started(name, attributes)
