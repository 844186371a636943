"""The relay's ``/metrics`` (names: ``metric_names``, ``OUTBOX_*``).

What the relay did (published, failures, publish latency) are plain numbers it bumps as the
broker confirms; what the table holds now (pending, failed, dead, the oldest waiting event) is
read from the store when Prometheus scrapes, so every relay on one database reports the same
figures. prometheus-client is imported only when the metrics are served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from rabbit_retry import metric_names as names
from rabbit_retry.worker.metrics import Durations

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    from rabbit_retry.outbox.store import Figures

log = logging.getLogger("rabbit_retry.outbox")

# From add to confirm: milliseconds when the relay keeps up, up to an hour when the broker was
# down or the relay stopped.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class Latencies(Durations):
    """One destination's publish latencies, counted like the worker's handler durations."""

    __slots__ = ()
    bounds = BUCKETS


class RelayMetrics:
    """The relay's numbers; ``figures`` reads the table's (the store's ``figures``)."""

    def __init__(self, destinations: Iterable[str] = (),
                 figures: Callable[[], Figures] | None = None) -> None:
        self.destinations = sorted(set(destinations))
        self.figures = figures
        self.published: dict[str, int] = dict.fromkeys(self.destinations, 0)
        self.failures: dict[str, int] = dict.fromkeys(self.destinations, 0)
        self.latency: dict[str, Latencies] = {d: Latencies() for d in self.destinations}
        self.heartbeat = 0.0  # unix time
        self.publishing = 0
        self._server: WSGIServer | None = None
        self._failing = False  # the store could not be read at the last scrape

    def beat(self) -> None:
        self.heartbeat = time.time()

    def confirmed(self, destination: str, added: datetime, at: datetime) -> None:
        self.published[destination] = self.published.get(destination, 0) + 1
        taken = self.latency.get(destination)
        if taken is None:
            taken = self.latency[destination] = Latencies()
        taken.observe(max(0.0, (at - added).total_seconds()))

    def failed(self, destination: str) -> None:
        self.failures[destination] = self.failures.get(destination, 0) + 1

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        def family(series: names.Series) -> CounterMetricFamily | GaugeMetricFamily:
            kind = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
            return kind(series.name, series.help, labels=series.labels)

        yield from self._table(family)
        for series, numbers in ((names.OUTBOX_PUBLISHED, self.published),
                                (names.OUTBOX_FAILURES, self.failures)):
            counter = family(series)
            for destination, count in sorted(numbers.items()):
                counter.add_metric([destination], count)
            yield counter
        seconds = names.OUTBOX_PUBLISH_SECONDS
        histogram = HistogramMetricFamily(seconds.name, seconds.help, labels=seconds.labels)
        bounds = [*map(floatToGoString, BUCKETS), "+Inf"]
        for destination, taken in sorted(self.latency.items()):
            histogram.add_metric([destination], list(zip(bounds, taken.cumulative(),
                                                         strict=True)), taken.sum)
        yield histogram
        for series, value in ((names.OUTBOX_HEARTBEAT, self.heartbeat),
                              (names.OUTBOX_PUBLISHING, self.publishing)):
            gauge = family(series)
            gauge.add_metric([], value)
            yield gauge

    def _table(self, family: Callable[[names.Series], CounterMetricFamily | GaugeMetricFamily]
               ) -> Iterator[Metric]:
        if self.figures is None:
            return
        try:
            figures = self.figures()
        except Exception as exc:  # the database is down: the relay's own numbers still serve
            if not self._failing:
                log.warning("relay metrics: cannot read the outbox table: %s",
                            (str(exc).strip().splitlines() or [type(exc).__name__])[0])
            self._failing = True
            return
        self._failing = False
        at = datetime.now(UTC)
        every = sorted(set(self.destinations) | set(figures.pending) | set(figures.failed)
                       | set(figures.dead) | set(figures.oldest))
        for series, numbers in ((names.OUTBOX_PENDING, figures.pending),
                                (names.OUTBOX_FAILED, figures.failed),
                                (names.OUTBOX_DEAD, figures.dead)):
            gauge = family(series)
            for destination in every:
                gauge.add_metric([destination], numbers.get(destination, 0))
            yield gauge
        oldest = family(names.OUTBOX_OLDEST_PENDING_SECONDS)
        for destination in every:
            first = figures.oldest.get(destination)
            oldest.add_metric([destination],
                              max(0.0, (at - first).total_seconds()) if first else 0.0)
        yield oldest

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` in a daemon thread; the bound port (``0`` picks one)."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(self)
        self._server, thread = start_http_server(port, addr, registry=registry)
        assert isinstance(thread, threading.Thread)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
