"""Prometheus metrics (README, "The worker"), in a registry of the runner's own; the series'
names, labels and help are ``rabbit_retry.metric_names``.

A dedicated ``CollectorRegistry`` per runner (not the global one) lets several runners, or
several tests, live in one process without colliding. Label children are bound once per queue
so the per-message cost is a lock and an addition, and every series exists (at 0) from start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rabbit_retry import metric_names as names
from rabbit_retry.worker.decide import ParkReason

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry

OUTCOMES = ("success", "retried", "parked")

# Handler durations from 1 ms to 5 min: fast handlers and ones near a 30 s timeout both show.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Count(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Level(Protocol):
    def set(self, value: float) -> None: ...


class Timing(Protocol):
    def observe(self, amount: float) -> None: ...


class _Kept:
    """A series no one can read (``Metrics(exported=False)``): kept as a number, no more."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, amount: float) -> None:
        self.value += amount


@dataclass(slots=True)
class QueueMetrics:
    """The metric children of one queue, bound once.

    ``in_flight`` is a plain integer the runner bumps; the gauge reads it when scraped, which
    keeps two locked updates per message off the success path.
    """

    success: Count
    retried: Count
    parked: Count
    parked_by_reason: dict[str, Count]
    handler_seconds: Timing
    paused: Level
    pauses: Count
    duplicates: Count
    in_flight: int = 0


class Metrics:
    """The worker's Prometheus series, or with ``exported=False`` (nothing can scrape them:
    ``run_consumers`` without a metrics port) the same counts as plain numbers, without
    importing prometheus-client."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, exported: bool = True
    ) -> None:
        self.exported = exported
        self._queues: dict[str, QueueMetrics] = {}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        if not exported:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.messages = Counter(
            names.MESSAGES.name,
            names.MESSAGES.help,
            names.MESSAGES.labels,
            registry=self.registry,
        )
        self.parked = Counter(
            names.PARKED.name,
            names.PARKED.help,
            names.PARKED.labels,
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            names.HANDLER_SECONDS.name,
            names.HANDLER_SECONDS.help,
            names.HANDLER_SECONDS.labels,
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            names.IN_FLIGHT.name,
            names.IN_FLIGHT.help,
            names.IN_FLIGHT.labels,
            registry=self.registry,
        )
        self.paused = Gauge(
            names.PAUSED.name,
            names.PAUSED.help,
            names.PAUSED.labels,
            registry=self.registry,
        )
        self.pauses = Counter(
            names.PAUSES.name,
            names.PAUSES.help,
            names.PAUSES.labels,
            registry=self.registry,
        )
        self.duplicates = Counter(
            names.DUPLICATES.name,
            names.DUPLICATES.help,
            names.DUPLICATES.labels,
            registry=self.registry,
        )

    def for_queue(self, queue: str) -> QueueMetrics:
        """The one ``QueueMetrics`` of ``queue`` (consumers of the same queue share it)."""
        bound = self._queues.get(queue)
        if bound is None and not self.exported:
            bound = QueueMetrics(
                success=_Kept(),
                retried=_Kept(),
                parked=_Kept(),
                parked_by_reason={r.value: _Kept() for r in ParkReason},
                handler_seconds=_Kept(),
                paused=_Kept(),
                pauses=_Kept(),
                duplicates=_Kept(),
            )
            self._queues[queue] = bound
        elif bound is None:
            bound = QueueMetrics(
                success=self.messages.labels(queue, "success"),
                retried=self.messages.labels(queue, "retried"),
                parked=self.messages.labels(queue, "parked"),
                parked_by_reason={r.value: self.parked.labels(queue, r.value) for r in ParkReason},
                handler_seconds=self.handler_seconds.labels(queue),
                paused=self.paused.labels(queue),
                pauses=self.pauses.labels(queue),
                duplicates=self.duplicates.labels(queue),
            )
            metrics = bound
            self.in_flight.labels(queue).set_function(lambda: metrics.in_flight)
            self._queues[queue] = bound
        return bound

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` over HTTP in a daemon thread; the bound port (``0`` picks one)."""
        if not self.exported:
            raise RuntimeError("Metrics(exported=False) cannot be served")
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
