"""What traces cost the worker's success path: the same worker with tracing off and on, in one
run, against the same broker.

Each run fills a queue with ``N`` persistent messages that carry a producer's ``traceparent``
(as a traced service publishes them: the worker reads it in every case), then one worker drains
it with a no-op handler. Runs alternate (off, on, on but not sampled, off, ...) so drift in the
machine or the broker hits all alike; each figure is the median of its runs. Client CPU per
message (this process's CPU time between the first delivery and the last completion) is the
figure that a busy broker cannot blur; msg/s is shown beside it.

- **off**: ``Runner(tracing=False)``: what a worker without a tracer provider runs (decided once
  at start: no wrapper, no call per message).
- **on**: OpenTelemetry's SDK as the global tracer provider, every span sampled (the producer's
  context says sampled), a ``BatchSpanProcessor`` in front of an exporter that drops what it
  gets: the worker's span, its attributes, the context made current for the handler, the
  exemplar, and the SDK's own work, but no network export.
- **on, not sampled**: the same provider, the producer's context says not sampled: the cost a
  head-sampled trace's unsampled messages pay (a non-recording span, contexts still carried).

The headline adds the same three without a broker (``bench.worker_overhead``: fake deliveries
through the worker's consuming path, CPU per message), where nothing else blurs the difference.

    python -m bench.bench_tracing [--messages 20000] [--runs 5] [--prefetch 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from support.amqp import persistent, publish_stream
from support.provision import provision

from bench import worker_overhead
from bench.bench_worker import QUEUE, Clock, NoOp, topology
from bench.common import throwaway_vhost
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Runner
from rabbit_retry.worker.metrics import Metrics

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SIDES = ("tracing off", "tracing on", "tracing on, not sampled")


class Dropped(SpanExporter):
    """Takes every batch and keeps nothing: the SDK's work without an exporter's."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def install_sdk() -> Dropped:
    """The SDK as the global tracer provider (once per process, as an application sets it)."""
    exporter = Dropped()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


async def fill(settings: Settings, n: int, sampled: bool) -> None:
    body = json.dumps({"order": 1, "total": 9.5, "sku": "x" * 64}).encode()
    flags = "01" if sampled else "00"

    def make(i: int) -> Any:
        return persistent(body, content_type="application/json", message_id=f"m-{i}",
                          headers={"traceparent": f"00-{TRACE}-{i + 1:016x}-{flags}"})

    await publish_stream(settings, QUEUE, n, make, window=500)


async def drain(settings: Settings, n: int, prefetch: int, traced: bool) -> Clock:
    clock = Clock(n)
    runner = Runner([NoOp(clock, prefetch)], topology=topology("quorum"), settings=settings,
                    metrics=Metrics(), tracing=traced)
    task = asyncio.create_task(runner.run())
    await clock.done.wait()
    runner.stop()
    await task
    assert (runner.trace is not None) is traced
    return clock


async def bench(settings: Settings, messages: int, runs: int, prefetch: int,
                cpu_messages: int = 20_000) -> dict[str, Any]:
    exporter = install_sdk()
    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    cpu: dict[str, list[float]] = {name: [] for name in SIDES}
    for i in range(runs):
        for name in SIDES:
            with throwaway_vhost(settings, "tracing") as scoped:
                await provision(scoped, topology("quorum"))
                await fill(scoped, messages, sampled=name == "tracing on")
                clock = await drain(scoped, messages, prefetch, traced=name != "tracing off")
            rates[name].append(clock.rate)
            cpu[name].append(clock.cpu_us)
            print(f"run {i + 1}/{runs} {name:<24} {clock.rate:8.0f} msg/s"
                  f" {clock.cpu_us:6.1f} us CPU/msg", file=sys.stderr)
    exported = exporter.spans  # the broker runs' (one per traced delivery)
    alone = await worker_overhead.measure(cpu_messages, max(runs, 3))
    trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]
    untraced, traced, not_sampled = (alone[name] for name in worker_overhead.TRACED)
    off_cpu, on_cpu, unsampled_cpu = (statistics.median(cpu[n]) for n in SIDES)
    off, on, unsampled = (statistics.median(rates[n]) for n in SIDES)
    return {
        "title": "Traces on the success path: the worker with tracing off and on",
        "columns": ["worker", "median msg/s", "median client CPU us/msg", "runs (msg/s)"],
        "rows": [
            [name, round(statistics.median(rates[name])), round(statistics.median(cpu[name]), 1),
             ", ".join(f"{x:.0f}" for x in rates[name])]
            for name in SIDES
        ],
        "headline": {
            "cpu us/msg added, sampled": round(on_cpu - off_cpu, 1),
            "cpu us/msg added, not sampled": round(unsampled_cpu - off_cpu, 1),
            "cpu ratio, sampled": round(on_cpu / off_cpu, 3),
            "msg/s ratio, sampled": round(on / off, 3),
            "msg/s ratio, not sampled": round(unsampled / off, 3),
            "no broker: cpu us/msg added, sampled": round(traced - untraced, 1),
            "no broker: cpu us/msg added, not sampled": round(not_sampled - untraced, 1),
            "no broker: cpu us/msg untraced": round(untraced, 1),
            "spans exported": exported,
        },
        "notes": [
            f"{messages} persistent messages per run, each with a producer's traceparent, quorum"
            f" queue, prefetch {prefetch}, {runs} alternating runs per side, median; no-op"
            " handler; one process, one broker.",
            "on: OpenTelemetry's SDK, a BatchSpanProcessor and an exporter that drops every"
            " batch (the SDK's work, not a network's). off: Runner(tracing=False), what a worker"
            " without a tracer provider runs.",
            f"no broker: bench.worker_overhead, {cpu_messages} fake deliveries carrying a"
            " traceparent through the worker's consuming path, alternating rounds, median CPU"
            " per message.",
        ],
        "params": {"messages": messages, "runs": runs, "prefetch": prefetch,
                   "cpu_messages": cpu_messages},
    }


def run(settings: Settings, **params: Any) -> dict[str, Any]:
    """Entry point for a harness: ``run(settings, messages=..., runs=..., prefetch=...)``."""
    return asyncio.run(bench(settings, int(params.get("messages", 20_000)),
                             int(params.get("runs", 5)), int(params.get("prefetch", 50)),
                             int(params.get("cpu_messages", 20_000))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefetch", type=int, default=50)
    parser.add_argument("--cpu-messages", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    outcome = run(Settings.from_env(), messages=args.messages, runs=args.runs,
                  prefetch=args.prefetch, cpu_messages=args.cpu_messages)
    if args.json:
        print(json.dumps(outcome, indent=2))
        return
    for row in outcome["rows"]:
        print(f"{row[0]:<26} {row[1]:>8} msg/s {row[2]:>7} us CPU/msg")
    for key, value in outcome["headline"].items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
