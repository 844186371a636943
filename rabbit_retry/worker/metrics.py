"""Prometheus metrics (README, "The worker"); the series' names, labels and help are
``rabbit_retry.metric_names``.

Each queue's series are plain numbers on one ``QueueMetrics``, bumped in place by the event
loop: no lock, no call into prometheus-client per message. With a metrics port, one collector in
a registry of the runner's own (not the global one: several runners, or tests, share a process)
reads them when Prometheus scrapes; without one, prometheus-client is never imported.

When the worker traces, each bucket of the handler durations keeps the trace id of the last
sampled delivery that fell in it (``ExemplarDurations``): an exemplar, which Prometheus reads in
the OpenMetrics format and Grafana turns into a link from a slow bucket to its trace.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rabbit_retry.worker.decide import ParkReason

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from rabbit_retry import metric_names as names

OUTCOMES = ("success", "retried", "parked")


@dataclass(frozen=True)
class Probes:
    """What ``/healthz`` and ``/readyz`` answer: ``(ok, why)``, asked in the server's thread."""

    live: Callable[[], tuple[bool, str]]
    ready: Callable[[], tuple[bool, str]]

# Handler durations from 1 ms to 5 min: fast handlers and ones near a 30 s timeout both show.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Durations:
    """One queue's handler durations: a count per bucket of ``bounds`` (the last one past every
    bound) and their sum. A subclass with other ``bounds`` counts other durations alike."""

    __slots__ = ("counts", "sum")
    bounds: tuple[float, ...] = BUCKETS

    def __init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # The first bound >= seconds: its `le`.
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def exemplars(self) -> list[tuple[str, float, float] | None]:
        """Per bucket, the (trace id, seconds, when) of its latest traced observation."""
        return [None] * len(self.counts)

    def cumulative(self) -> list[int]:
        """Observations at or under each bound, ``+Inf`` last, as Prometheus exposes them."""
        total, out = 0, []
        for count in list(self.counts):
            total += count
            out.append(total)
        return out


class ExemplarDurations(Durations):
    """``Durations`` that also keep, per bucket, the trace id ``trace_id`` gives for the latest
    observation in it (None: that one is not traced): only a tracing worker pays for it."""

    __slots__ = ("_kept", "_trace_id")

    def __init__(self, trace_id: Callable[[], str | None]) -> None:
        super().__init__()
        self._trace_id = trace_id
        self._kept: list[tuple[str, float, float] | None] = [None] * len(self.counts)

    def observe(self, seconds: float) -> None:
        bucket = bisect_left(BUCKETS, seconds)
        self.counts[bucket] += 1
        self.sum += seconds
        trace_id = self._trace_id()
        if trace_id is not None:
            self._kept[bucket] = (trace_id, seconds, time.time())

    def exemplars(self) -> list[tuple[str, float, float] | None]:
        return list(self._kept)


class QueueMetrics:
    """The series of one queue, as numbers the session bumps (``success += 1``)."""

    __slots__ = ("duplicates", "handler_seconds", "held_sources", "in_flight", "internal_errors",
                 "parked", "parked_by_reason", "paused", "pauses", "retried", "success")

    def __init__(self) -> None:
        self.success = 0
        self.retried = 0
        self.parked = 0
        self.parked_by_reason = dict.fromkeys((r.value for r in ParkReason), 0)
        self.handler_seconds = Durations()
        self.in_flight = 0
        self.paused = 0  # 1 while a Pause holds the queue
        self.pauses = 0
        self.duplicates = 0
        self.internal_errors = 0
        # An ordered queue's lanes on this worker, each saying (held keys, oldest hold's start).
        self.held_sources: list[Callable[[], tuple[int, float | None]]] = []

    def held(self) -> tuple[int, float]:
        """Held keys, and seconds the oldest has been held (0 when none is)."""
        keys, oldest = 0, None
        for source in list(self.held_sources):
            count, since = source()
            keys += count
            if since is not None and (oldest is None or since < oldest):
                oldest = since
        return keys, 0.0 if oldest is None else max(0.0, time.time() - oldest)


class Metrics:
    """Every queue's ``QueueMetrics``; with ``exported`` (the default) also a registry that
    serves them. ``run_consumers`` without a metrics port passes ``exported=False``."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, exported: bool = True
    ) -> None:
        self.exported = exported
        self._queues: dict[str, QueueMetrics] = {}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._trace_id: Callable[[], str | None] | None = None
        if not exported:
            return
        from prometheus_client import CollectorRegistry

        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)  # a collector: ``collect`` below

    def for_queue(self, queue: str) -> QueueMetrics:
        """The one ``QueueMetrics`` of ``queue`` (consumers of the same queue share it)."""
        bound = self._queues.get(queue)
        if bound is None:
            bound = self._queues[queue] = QueueMetrics()
            if self._trace_id is not None:
                bound.handler_seconds = ExemplarDurations(self._trace_id)
        return bound

    def keep_exemplars(self, trace_id: Callable[[], str | None]) -> None:
        """From now on every queue's handler durations keep exemplars (a tracing worker)."""
        self._trace_id = trace_id
        for queue in self._queues.values():
            if not isinstance(queue.handler_seconds, ExemplarDurations):
                queue.handler_seconds = ExemplarDurations(trace_id)

    def collect(self) -> Iterator[Metric]:
        """The series as Prometheus reads them (called in the scraping thread)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.samples import Exemplar
        from prometheus_client.utils import floatToGoString

        from rabbit_retry import metric_names as names  # only a served registry needs them

        out: dict[names.Series, CounterMetricFamily | GaugeMetricFamily] = {
            series: (CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily)(
                series.name, series.help, labels=series.labels
            )
            for series in names.WORKER
            if series is not names.HANDLER_SECONDS
        }
        seconds = names.HANDLER_SECONDS
        durations = HistogramMetricFamily(seconds.name, seconds.help, labels=seconds.labels)
        bounds = [*map(floatToGoString, BUCKETS), "+Inf"]
        for queue, m in list(self._queues.items()):
            for outcome in OUTCOMES:
                out[names.MESSAGES].add_metric([queue, outcome], getattr(m, outcome))
            for reason, count in list(m.parked_by_reason.items()):
                out[names.PARKED].add_metric([queue, reason], count)
            held_keys, oldest_held = m.held()
            for series, value in ((names.HELD_KEYS, held_keys), (names.OLDEST_HELD, oldest_held),
                                  (names.IN_FLIGHT, m.in_flight), (names.PAUSED, m.paused),
                                  (names.PAUSES, m.pauses), (names.DUPLICATES, m.duplicates),
                                  (names.INTERNAL_ERRORS, m.internal_errors)):
                out[series].add_metric([queue], value)
            taken = m.handler_seconds
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            for bound, count, kept in zip(bounds, taken.cumulative(), taken.exemplars(),
                                          strict=True):
                if kept is None:
                    buckets.append((bound, count))
                else:
                    trace_id, took, when = kept
                    buckets.append((bound, count, Exemplar({"trace_id": trace_id}, took, when)))
            durations.add_metric([queue], buckets, taken.sum)
        yield from out.values()
        yield durations

    def serve(self, port: int, addr: str = "0.0.0.0", probes: Probes | None = None) -> int:
        """Serve ``/metrics`` (and with ``probes``, ``/healthz`` and ``/readyz``) over HTTP in a
        daemon thread; the bound port (``0`` picks one). Any other path: 404."""
        if not self.exported:
            raise RuntimeError("Metrics(exported=False) cannot be served")
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        from prometheus_client import make_wsgi_app

        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO") or "/"
            if path == "/metrics":
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            check = {"/healthz": probes.live, "/readyz": probes.ready}.get(path) if probes else None
            if check is None:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: /metrics, /healthz and /readyz are served here\n"]
            ok, why = check()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{why}\n".encode()]

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """Scrapes and probes every few seconds are not news."""

        server = make_server(addr, port, app, server_class=Server, handler_class=Quiet)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True,
                                        name="rabbit-retry-metrics")
        self._thread.start()
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
