"""Ordered keys: the worker on an ordered queue (1,000 keys over its lanes) against the same
worker on a plain queue.

Both are ``rabbit-retry worker bench.consumers:Noop`` processes draining the same backlog of
persistent messages, published through a direct exchange that feeds the queue (the ordered
queue's lanes exchange, for the ordered one), each message carrying one of 1,000 keys in a
header. The ordered worker consumes every lane (one worker: it is each lane's single active
consumer) with the same prefetch per lane; its messages of one key run one after another. The
figure is messages a second from the first handler call to the N-th; the aim is 0.8.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.broker import enable_plugin
from support.provision import provision_sync

from bench import common
from bench.probe import QUEUE
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

GOAL = 0.8


def topology(queue_type: str, lanes: int | None) -> str:
    ordered = f"    ordered: {{key: {{header: key}}, lanes: {lanes}}}\n" if lanes else ""
    return (
        "version: 1\n"
        "exchanges:\n"
        "  bench: {type: direct}\n"
        "queues:\n"
        f"  {QUEUE}:\n"
        f"    queue_type: {queue_type}\n"
        f"    bindings: [{{exchange: bench, routing_key: {QUEUE}}}]\n"
        f"{ordered}"
        "    retry: {delays: [5s], max_attempts: 3}\n"
    )


def run(
    settings: Settings,
    *,
    n: int = 20_000,
    runs: int = 3,
    keys: int = 1_000,
    lanes: int = 4,
    prefetch: int = 50,
    queue_type: str = "quorum",
    timeout: float = 600.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    with Management.for_settings(settings) as api:
        enable_plugin(api, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")

    def message(i: int) -> Any:
        return common.json_message({"id": i}, message_id=str(i), headers={"key": f"k{i % keys}"})

    def measure(lane_count: int | None) -> float:
        text = topology(queue_type, lane_count)

        def argv(s: Settings, workdir: Path) -> list[str]:
            path = common.write_topology(workdir, text)
            return common.rabbit_retry_cli("--url", s.url, "worker", "bench.consumers:Noop",
                                           "-t", str(path))

        drain = common.measure_drain(
            settings, "ordered" if lane_count else "plain",
            setup=lambda s: provision_sync(s, text), argv=argv, n=n, make=message,
            queue=QUEUE, timeout=timeout, env={"BENCH_PREFETCH": str(prefetch)},
            exchange="bench",
        )
        return drain.rate

    systems = {f"ordered ({keys:,} keys, {lanes} lanes)": lambda: measure(lanes),
               "plain queue": lambda: measure(None)}
    log(f"ordered: {n:,} messages x {runs} runs")
    samples = common.alternate(runs, systems, log=log)
    notes = [
        f"{n:,} persistent messages on {queue_type} queues, each with one of {keys:,} keys in a "
        f"header, published through a direct exchange before the worker starts; prefetch "
        f"{prefetch} (per lane for the ordered queue); median of {runs} alternating runs. The "
        "figure is messages a second, first handler call to the N-th, as the worker's own "
        "probe counts them.",
        f"Ordered: `ordered: {{key: {{header: key}}, lanes: {lanes}}}`, one worker (the single "
        "active consumer of every lane), a key's messages one after another. Plain: the same "
        "queue without `ordered`.",
    ]
    return common.throughput_result(
        f"Ordered keys: {keys:,} keys against a plain queue",
        samples,
        ours=f"ordered ({keys:,} keys, {lanes} lanes)",
        baseline="plain queue",
        unit="msg/s",
        goal=GOAL,
        notes=notes,
        params={"n": n, "runs": runs, "keys": keys, "lanes": lanes, "prefetch": prefetch,
                "queue_type": queue_type},
    )
