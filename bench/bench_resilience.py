"""What Idempotency and Pause cost: the worker's success path with each idempotency store
against the same worker without one, and how fast a Pause reacts to an outage and its end.

Throughput: like bench_worker.py (same process, same broker, persistent messages, alternating
runs, medians), the worker with a no-op handler, once without idempotency and once per store
(SQLite in a temporary file, PostgreSQL and Redis on this machine); every message has its own
message id, so every one is claimed and recorded.

Reaction: the downstream goes down while messages flow; we count the handler calls that failed
before the queue paused (what the outage cost in attempts) and the seconds from the first
failure to the pause, then bring the downstream back and time the resume (bounded by
``probe_every``).

    python -m bench.bench_resilience [--messages 5000] [--runs 3] [--prefetch 50] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from support.provision import provision
from support.stores import POSTGRES_URL, REDIS_URL

from bench.bench_worker import QUEUE, Clock, fill, measure, our_worker, topology
from bench.common import throwaway_vhost
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Idempotency, Pause, RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics
from rabbit_retry.worker.stores import open_store

# The servers scripts/test.sh makes sure of (it exports the TEST variables).
POSTGRES = os.environ.get("RABBIT_RETRY_BENCH_POSTGRES_URL") or POSTGRES_URL
REDIS = os.environ.get("RABBIT_RETRY_BENCH_REDIS_URL") or REDIS_URL
GOAL = "measured, no target: each store's ratio to the worker without one"


async def reachable(url: str) -> bool:
    store = open_store(url)
    try:
        await store.open()
    except Exception as exc:
        print(f"skipping {store.url}: {exc}", file=sys.stderr)
        return False
    await store.close()
    return True


async def throughput(settings: Settings, messages: int, runs: int,
                     prefetch: int, scratch: Path) -> dict[str, list[float]]:
    topo = topology("quorum")
    stores: dict[str, str | None] = {"no idempotency": None,
                                     "SQLite": f"sqlite:///{scratch / 'keys.db'}",
                                     "PostgreSQL": POSTGRES, "Redis": REDIS}
    for name, url in list(stores.items()):
        if url is not None and not await reachable(url):
            del stores[name]
    rates: dict[str, list[float]] = {name: [] for name in stores}
    for i in range(runs):
        for name, url in stores.items():
            # A fresh key space per run: the message ids repeat from run to run.
            space = uuid.uuid4().hex[:8]
            rule = None if url is None else Idempotency(
                url, window=3600, key=lambda d, space=space: f"{space}-{d.message_id}")

            def side(s: Settings, rule: Idempotency | None = rule) -> Awaitable[Clock]:
                return our_worker(s, messages, prefetch, topo, rule)

            clock = await measure(settings, side, messages, topo)
            rates[name].append(clock.rate)
            print(f"run {i + 1}/{runs} {name:<16} {clock.rate:8.0f} msg/s", file=sys.stderr)
    return rates


class Flaky(RetryConsumer):
    """Goes down after ``up_for`` successes (mid-backlog, whatever the speed) and fails until
    ``down`` is cleared; notes the calls that failed before the pause."""

    queue = QUEUE

    def __init__(self, prefetch: int, rule: Pause, up_for: int) -> None:
        self.prefetch = prefetch
        self.pause = rule
        self.up_for = up_for
        self.down = False
        self.successes = 0
        self.failed_calls = 0
        self.first_failure = 0.0

    async def handle(self, delivery: Delivery) -> None:
        await asyncio.sleep(0.001)
        if not self.down and not self.first_failure and self.successes >= self.up_for:
            self.down = True
        if self.down:
            if not self.first_failure:
                self.first_failure = time.perf_counter()
            self.failed_calls += 1
            raise ConnectionError("bench: downstream down")
        self.successes += 1


async def until(condition: Callable[[], bool], what: str, within: float = 120.0) -> None:
    """Poll every millisecond: the gauge has no event to wait on, and a millisecond is the
    resolution these figures need."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench_resilience: no {what} within {within:g}s")
        await asyncio.sleep(0.001)


async def reaction(settings: Settings, prefetch: int,
                   rule: Pause, backlog: int) -> dict[str, float]:
    topo = topology("quorum")
    with throwaway_vhost(settings, "resilience") as scoped:
        await provision(scoped, topo)
        await fill(scoped, backlog)
        consumer = Flaky(prefetch, rule, up_for=backlog // 3)
        runner = Runner([consumer], topology=topo, settings=scoped, metrics=Metrics())
        task = asyncio.create_task(runner.run())
        queue_metrics = runner.metrics.for_queue(QUEUE)
        await until(lambda: queue_metrics.paused == 1, "pause")
        paused_after = time.perf_counter() - consumer.first_failure
        calls_to_pause = consumer.failed_calls
        await asyncio.sleep(1.0)
        failed_while_paused = consumer.failed_calls - calls_to_pause
        back = time.perf_counter()
        consumer.down = False
        await until(lambda: queue_metrics.paused == 0, "resume")
        resumed_after = time.perf_counter() - back
        runner.stop()
        await task
        return {"failed calls before the pause": calls_to_pause,
                "seconds from first failure to pause": paused_after,
                "failed calls in the first second paused": failed_while_paused,
                "seconds from recovery to resume": resumed_after,
                "retried (charged attempts)": queue_metrics.retried}


async def bench(settings: Settings, messages: int, runs: int, prefetch: int,
                backlog: int) -> dict[str, Any]:
    rule = Pause(after=5, probe_every=2.0)
    with tempfile.TemporaryDirectory() as scratch:
        rates = await throughput(settings, messages, runs, prefetch, Path(scratch))
        reactions = [await reaction(settings, prefetch, rule, backlog) for _ in range(runs)]
    base = statistics.median(rates["no idempotency"])
    rows = [[name, round(statistics.median(r)), round(statistics.median(r) / base, 3),
             ", ".join(f"{x:.0f}" for x in r)] for name, r in rates.items()]
    reaction_rows = [[key, round(statistics.median(r[key] for r in reactions), 3),
                      ", ".join(f"{r[key]:.3g}" for r in reactions)] for key in reactions[0]]
    return {
        "title": "Idempotency stores and Pause: cost on the success path, reaction to an outage",
        "columns": ["worker", "median msg/s", "ratio to no idempotency", "runs (msg/s)"],
        "rows": rows,
        "reaction": {"columns": ["Pause(after=5, probe_every=2)", "median", "runs"],
                     "rows": reaction_rows},
        "headline": {
            **{f"{name} / none": row[2] for name, row in zip(rates, rows, strict=True)
               if name != "no idempotency"},
            **{f"pause: {row[0]}": row[1] for row in reaction_rows},
        },
        "goal": GOAL,
        "notes": [
            f"{messages} persistent messages per run, quorum queue, prefetch {prefetch}, {runs}"
            " alternating runs per side, median; no-op handler; every message has its own id,"
            " so each is claimed and recorded (two store round trips).",
            "Reaction, Pause(after=5, probe_every=2), median of the runs (each run's figures in"
            " brackets): " + "; ".join(f"{row[0]}: {row[1]} ({row[2]})" for row in reaction_rows)
            + ". Prefetch deliveries are in flight when the downstream fails; those past the"
            " trip go back to the queue uncharged, so 'retried' stays at `after`.",
        ],
        "params": {"messages": messages, "runs": runs, "prefetch": prefetch,
                   "backlog": backlog},
    }


def run(settings: Settings, **params: Any) -> dict[str, Any]:
    return asyncio.run(bench(settings, int(params.get("messages", 5_000)),
                             int(params.get("runs", 3)), int(params.get("prefetch", 50)),
                             int(params.get("backlog", 5_000))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = Settings.from_env(os.environ.get("RABBIT_RETRY_URL"))
    result = run(settings, messages=args.messages, runs=args.runs, prefetch=args.prefetch)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for row in result["rows"]:
        print(f"{row[0]:<16} {row[1]:>8} msg/s  x{row[2]:<6} ({row[3]})")
    for row in result["reaction"]["rows"]:
        print(f"{row[0]:<42} {row[1]:>8}  ({row[2]})")


if __name__ == "__main__":
    main()
