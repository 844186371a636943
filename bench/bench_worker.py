"""The worker's success path against bare consume-and-ack loops, side by side: aio-pika acking
each delivery, aiormq acking each delivery, and aiormq acking every 100th with ``multiple``
(what an at-least-once consumer can do at best: the worker's acks in groups aim at 0.8x of it).

Same process, same broker, same queue type, same prefetch, same persistent messages: each run
fills the queue with ``N`` messages, then one consumer drains it. Runs alternate (aio-pika,
ours, aiormq, aio-pika, ...) so drift in the machine or the broker hits all alike, and each
side's figure is the median of its runs. Throughput is measured from the first delivery to the
last completion, so connection setup and the worker's startup check are not counted; the
process's CPU time over the same window gives the client's cost per message, which a busy
broker cannot blur. A bare aiormq loop (the layer the worker is built on) shows the worker's
own overhead.

    python -m bench.bench_worker [--messages 20000] [--runs 5] [--prefetch 200]
                                 [--queue-type quorum] [--profile] [--json]

Each run uses a throwaway vhost of its own (``rr-bench-<BENCH_RUN_ID>-worker-...``), deleted
afterwards. ``--profile`` runs our worker
once more under pyinstrument (if installed) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage
from support.amqp import persistent, publish_stream
from support.provision import provision

from bench.common import throwaway_vhost
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology, parse_topology
from rabbit_retry.worker import Delivery, Idempotency, RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics

QUEUE = "bench.worker"
GOAL = 0.9  # ours / bare aio-pika acking each
GROUP_GOAL = 0.8  # ours / bare aiormq acking every GROUP with multiple
GROUP = 100


def topology(queue_type: str) -> Topology:
    return parse_topology(
        f"""\
version: 1
queues:
  {QUEUE}:
    queue_type: {queue_type}
    retry: {{delays: [1s, 5s], max_attempts: 3}}
""",
        "bench-worker.yml",
    )


class Clock:
    """First delivery and last completion; ``done`` once ``target`` completions were seen."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.cpu_first = 0.0
        self.cpu_last = 0.0
        self.done = asyncio.Event()

    def start(self) -> None:
        if not self.first:
            self.first = time.perf_counter()
            self.cpu_first = time.process_time()

    def complete(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.last = time.perf_counter()
            self.cpu_last = time.process_time()
            self.done.set()

    @property
    def rate(self) -> float:
        return max(self.count - 1, 1) / max(self.last - self.first, 1e-9)

    @property
    def cpu_us(self) -> float:
        """This process's CPU time per message (the client's cost, whatever the broker does)."""
        return (self.cpu_last - self.cpu_first) / max(self.count - 1, 1) * 1e6


async def fill(settings: Settings, n: int) -> None:
    """``n`` persistent messages, confirmed in windows of 500."""
    body = json.dumps({"order": 1, "total": 9.5, "sku": "x" * 64}).encode()

    def make(i: int) -> aio_pika.Message:
        return persistent(body, content_type="application/json", message_id=f"m-{i}")

    await publish_stream(settings, QUEUE, n, make, window=500)


async def bare_loop(settings: Settings, n: int, prefetch: int) -> Clock:
    """The baseline: aio-pika consume with a callback that acks."""
    clock = Clock(n)
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.get_queue(QUEUE, ensure=False)

        async def on_message(message: AbstractIncomingMessage) -> None:
            clock.start()
            await message.ack()
            clock.complete()

        await queue.consume(on_message)
        await clock.done.wait()
    return clock


async def bare_aiormq(settings: Settings, n: int, prefetch: int, group: int = 1) -> Clock:
    """What the worker itself builds on: aiormq's consume callback and basic_ack; with
    ``group``, only every ``group``-th delivery (and the last) is acked, with ``multiple``: the
    ceiling of an at-least-once consumer, no handler, no decision."""
    clock = Clock(n)
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.basic_qos(prefetch_count=prefetch)

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            clock.start()
            seen = clock.count + 1
            if seen % group == 0 or seen == n:
                await channel.basic_ack(
                    message.delivery.delivery_tag,  # type: ignore[union-attr,arg-type]
                    multiple=group > 1,
                )
            clock.complete()

        await channel.basic_consume(QUEUE, on_message)
        await clock.done.wait()
    finally:
        await connection.close()
    return clock


class NoOp(RetryConsumer):
    queue = QUEUE

    def __init__(self, clock: Clock, prefetch: int, idempotency: Idempotency | None = None) -> None:
        self.clock = clock
        self.prefetch = prefetch
        self.idempotency = idempotency

    async def handle(self, delivery: Delivery) -> None:
        self.clock.start()
        self.clock.complete()


async def our_worker(
    settings: Settings, n: int, prefetch: int, topo: Topology,
    idempotency: Idempotency | None = None,
) -> Clock:
    clock = Clock(n)
    # The handler counts before its message is acked; the last ack follows within one step,
    # and is counted by waiting for the runner to finish the in-flight ones on stop.
    runner = Runner([NoOp(clock, prefetch, idempotency)], topology=topo, settings=settings,
                    metrics=Metrics())
    task = asyncio.create_task(runner.run())
    await clock.done.wait()
    runner.stop()
    await task
    return clock


async def measure(
    settings: Settings,
    side: Callable[[Settings], Awaitable[Clock]],
    n: int,
    topo: Topology,
) -> Clock:
    with throwaway_vhost(settings, "worker") as scoped:
        await provision(scoped, topo)
        await fill(scoped, n)
        return await side(scoped)


async def bench(
    settings: Settings, messages: int, runs: int, prefetch: int, queue_type: str
) -> dict[str, Any]:
    topo = topology(queue_type)
    names = ("bare aio-pika", "rabbit-retry worker", "bare aiormq",
             f"bare aiormq, ack every {GROUP}")
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(runs):
        for name, side in zip(
            names,
            (
                lambda s: bare_loop(s, messages, prefetch),
                lambda s: our_worker(s, messages, prefetch, topo),
                lambda s: bare_aiormq(s, messages, prefetch),
                lambda s: bare_aiormq(s, messages, prefetch, GROUP),
            ),
            strict=True,
        ):
            clock = await measure(settings, side, messages, topo)
            rates[name].append(clock.rate)
            cpu[name].append(clock.cpu_us)
            print(
                f"run {i + 1}/{runs} {name:<20} {clock.rate:8.0f} msg/s"
                f" {clock.cpu_us:6.1f} us CPU/msg",
                file=sys.stderr,
            )
    bare, ours, floor, ceiling = (statistics.median(rates[n]) for n in names)
    bare_cpu, ours_cpu, floor_cpu, _ = (statistics.median(cpu[n]) for n in names)
    return {
        "title": "Worker success path vs a bare aio-pika consume-and-ack loop",
        "columns": ["consumer", "median msg/s", "median client CPU us/msg", "runs (msg/s)"],
        "rows": [
            [
                name,
                round(statistics.median(rates[name])),
                round(statistics.median(cpu[name]), 1),
                ", ".join(f"{x:.0f}" for x in rates[name]),
            ]
            for name in names
        ],
        "headline": {
            "ratio": round(ours / bare, 3),
            "bare msg/s": round(bare),
            "ours msg/s": round(ours),
            "cpu ratio": round(ours_cpu / bare_cpu, 3),
            "ratio vs aiormq": round(ours / floor, 3),
            "cpu ratio vs aiormq": round(ours_cpu / floor_cpu, 3),
            "ratio vs grouped acks": round(ours / ceiling, 3),
        },
        "goal": f"ratio >= {GOAL}; ratio vs grouped acks >= {GROUP_GOAL}",
        "notes": [
            f"{messages} persistent messages per run, {queue_type} queue, prefetch {prefetch},"
            f" {runs} alternating runs per side, median; no-op handler; both consumers in one"
            " process against the same broker.",
            "bare aiormq is the layer the worker is built on: ours vs it is the worker's own"
            " overhead (decision, metrics, timeout scope, Delivery object).",
            f"bare aiormq acking every {GROUP}th delivery with multiple is the ceiling of an"
            " at-least-once consumer: the worker acks in groups too (a tenth of the prefetch"
            " per frame at most), and aims at 0.8x of it.",
        ],
        "params": {
            "messages": messages,
            "runs": runs,
            "prefetch": prefetch,
            "queue_type": queue_type,
        },
    }


async def profile(settings: Settings, messages: int, prefetch: int, queue_type: str) -> None:
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("pip install pyinstrument to profile", file=sys.stderr)
        return
    topo = topology(queue_type)
    profiler = Profiler(async_mode="enabled")
    profiler.start()
    await measure(settings, lambda s: our_worker(s, messages, prefetch, topo), messages, topo)
    profiler.stop()
    print(profiler.output_text(unicode=True, color=False, show_all=False))


def run(settings: Settings, **params: Any) -> dict[str, Any]:
    """Entry point for a harness: ``run(settings, messages=..., runs=..., prefetch=...)``."""
    return asyncio.run(
        bench(
            settings,
            int(params.get("messages", 20_000)),
            int(params.get("runs", 5)),
            int(params.get("prefetch", 200)),
            str(params.get("queue_type", "quorum")),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefetch", type=int, default=200)
    parser.add_argument("--queue-type", choices=["quorum", "classic"], default="quorum")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    settings = Settings.from_env(os.environ.get("RABBIT_RETRY_URL"))
    if args.profile:
        asyncio.run(profile(settings, args.messages, args.prefetch, args.queue_type))
        return
    result = run(
        settings,
        messages=args.messages,
        runs=args.runs,
        prefetch=args.prefetch,
        queue_type=args.queue_type,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for row in result["rows"]:
        print(f"{row[0]:<22} {row[1]:>8} msg/s {row[2]:>7} us CPU/msg   ({row[3]})")
    headline = result["headline"]
    print(f"throughput ratio ours/bare: {headline['ratio']:.3f} (goal >= {GOAL})")
    print(f"client CPU per message ours/bare: {headline['cpu ratio']:.3f}")
    print(
        f"vs bare aiormq: throughput {headline['ratio vs aiormq']:.3f},"
        f" CPU per message {headline['cpu ratio vs aiormq']:.3f}"
    )
    print(f"vs bare aiormq acking every {GROUP}: throughput"
          f" {headline['ratio vs grouped acks']:.3f} (goal >= {GROUP_GOAL})")


if __name__ == "__main__":
    main()
