"""The desk's ``/metrics``: read from the store at each scrape, so that every desk sharing one
database reports the same figures and a restart resets nothing (names: ``metric_names``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rabbit_retry import metric_names as names
from rabbit_retry.desk.store import Store
from rabbit_retry.worker.decide import ParkReason

REASONS = tuple(reason.value for reason in ParkReason)
_KINDS = {"ingested": names.DESK_INGESTED, "replayed": names.DESK_REPLAYED,
          "discarded": names.DESK_DISCARDED}


def _counter_name(series: names.Series) -> str:
    # prometheus-client appends _total to a counter family's name itself.
    return series.name.removesuffix("_total")


class DeskCollector(Collector):
    def __init__(self, store: Store, queues: list[str]) -> None:
        self.store = store
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        parked = GaugeMetricFamily(names.DESK_PARKED.name, names.DESK_PARKED.help,
                                   labels=list(names.DESK_PARKED.labels))
        oldest = GaugeMetricFamily(names.DESK_OLDEST_PARKED_SECONDS.name,
                                   names.DESK_OLDEST_PARKED_SECONDS.help,
                                   labels=list(names.DESK_OLDEST_PARKED_SECONDS.labels))
        now = datetime.now(UTC)
        first_by_queue: dict[str, datetime] = {}
        # Every queue of the topology has every reason's series, at 0 when nothing is parked
        # for it: a series that vanishes reads as "no data", not as "nothing parked".
        counts = {(queue, reason): 0 for queue in self.queues for reason in REASONS}
        for queue, reason, count, first in self.store.parked_by():
            counts[(queue, reason or "unknown")] = count
            if first is not None and (queue not in first_by_queue
                                      or first < first_by_queue[queue]):
                first_by_queue[queue] = first
        for (queue, reason), count in sorted(counts.items()):
            parked.add_metric([queue, reason], count)
        for queue in sorted(set(self.queues) | set(first_by_queue)):
            first = first_by_queue.get(queue)
            oldest.add_metric([queue], max(0.0, (now - first).total_seconds()) if first else 0.0)
        yield parked
        yield oldest
        counters = {kind: CounterMetricFamily(_counter_name(s), s.help, labels=list(s.labels))
                    for kind, s in _KINDS.items()}
        seen: set[tuple[str, str]] = set()
        for queue, kind, count in self.store.totals():
            if kind in counters:
                counters[kind].add_metric([queue], count)
                seen.add((queue, kind))
        for queue in self.queues:  # every queue has every series, at 0 before anything happened
            for kind, family in counters.items():
                if (queue, kind) not in seen:
                    family.add_metric([queue], 0)
        yield from counters.values()
