"""Benchmark 2, the retry path: every message fails once, waits in one short tier, then succeeds.

Ours: ``rabbit-retry worker bench.consumers:RetryOnce`` on a one-tier topology (with one delay
the worker nacks and the broker moves the message). Baseline: bare aio-pika doing the same by
hand (``bench/baseline_aiopika.py retry``): nack, the main queue dead-letters to a TTL queue
that dead-letters back. Same queue type, prefetch and persistent messages; the figure is
messages completed per second from the first delivery to the N-th success (2N deliveries).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.amqp import blocking
from support.provision import provision_sync

from bench import common
from bench.baseline_aiopika import declare_retry_by_hand
from bench.probe import QUEUE
from rabbit_retry.settings import Settings
from rabbit_retry.topology.durations import parse_duration

GOAL = 0.9


def run(
    settings: Settings,
    *,
    n: int = 10_000,
    runs: int = 3,
    prefetch: int = 50,
    queue_type: str = "quorum",
    delay: str = "100ms",
    style: str = "callback",
    timeout: float = 300.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    delay_ms = parse_duration(delay)
    topology = common.queue_topology(QUEUE, delays=[delay], max_attempts=3, queue_type=queue_type)

    def message(i: int) -> Any:
        return common.json_message({"id": i}, message_id=str(i))

    def ours() -> float:
        def argv(s: Settings, workdir: Path) -> list[str]:
            path = common.write_topology(workdir, topology)
            return common.rabbit_retry_cli(
                "--url", s.url, "worker", "bench.consumers:RetryOnce", "-t", str(path)
            )

        drain = common.measure_drain(
            settings,
            "retry-ours",
            setup=lambda s: provision_sync(s, topology),
            argv=argv,
            n=n,
            make=message,
            queue=QUEUE,
            timeout=timeout,
            env={"BENCH_PREFETCH": str(prefetch)},
        )
        return drain.rate

    def baseline() -> float:
        drain = common.measure_drain(
            settings,
            "retry-bare",
            setup=lambda s: blocking(
                declare_retry_by_hand(s.url, QUEUE, delay_ms, queue_type), timeout=None
            ),
            argv=lambda s, _: common.python_module(
                "bench.baseline_aiopika",
                "retry",
                "--url",
                s.url,
                "--queue",
                QUEUE,
                "--prefetch",
                str(prefetch),
                "--style",
                style,
            ),
            n=n,
            make=message,
            queue=QUEUE,
            timeout=timeout,
        )
        return drain.rate

    systems: dict[str, Callable[[], float]] = {"bare aio-pika": baseline}
    how = (
        "nacks and the broker dead-letters at-least-once into the tier"
        if queue_type == "quorum"
        else "publishes a copy to the tier, waits for its confirm, then acks"
    )
    notes = [
        f"{n:,} persistent messages, each failing once; tier {delay}; {queue_type} queues; "
        f"prefetch {prefetch}; median of {runs} alternating runs. The figure is messages "
        "completed a second, first delivery to N-th success (2N deliveries); each consumer "
        "runs in a process of its own, started after the backlog was published.",
        f"Ours: `rabbit-retry worker` with one delay on a {queue_type} queue {how}. Baseline: "
        f"bare aio-pika ({style} style: each delivery its own task, as aiormq dispatches "
        f"them), nack -> `{QUEUE}.wait` (TTL) -> back to `{QUEUE}`, queues declared by hand.",
    ]
    systems = {"rabbit-retry worker": ours, **systems}
    log(f"retry path: {n:,} messages x {runs} runs")
    samples = common.alternate(runs, systems, log=log)
    return common.throughput_result(
        "Retry path: fail once, one short tier, then succeed",
        samples,
        ours="rabbit-retry worker",
        baseline="bare aio-pika",
        unit="msg/s",
        goal=GOAL,
        notes=notes,
        params={
            "n": n,
            "runs": runs,
            "prefetch": prefetch,
            "queue_type": queue_type,
            "delay": delay,
            "baseline_style": style,
        },
    )
