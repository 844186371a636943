"""The worker's own CPU per message, without a broker: the same fake deliveries fed to the
worker's consuming path (``Session._deliver``: the lane's turn, a no-op handler, ack, metrics,
the handler's timeout) and to a bare callback that only acks, as aiormq would call them (each
delivery a task of its own, at most ``prefetch`` in flight), alternating, median of the rounds.

A broker makes throughput on a shared machine swing by tens of percent between runs; this
isolates the part of a message's cost that the worker adds, which is what section 1 of
docs/benchmarks.md compares against bare aiormq.

With OpenTelemetry's SDK installed, three more sides take messages that carry a producer's
``traceparent``: the worker untraced, traced (the SDK as tracer provider, a
``BatchSpanProcessor``, an exporter that drops every batch), and traced with the producer's
context not sampled. ``bench/bench_tracing.py`` measures the same against a broker.

    python -m bench.worker_overhead [--messages 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from aiormq import spec
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from rabbit_retry.topology import parse_topology
from rabbit_retry.worker import Delivery, RetryConsumer
from rabbit_retry.worker.metrics import Metrics
from rabbit_retry.worker.runner import subscribe
from rabbit_retry.worker.session import Session

PREFETCH = 50
TOPOLOGY = parse_topology(
    "version: 1\nqueues:\n  q: {queue_type: quorum, retry: {delays: [1s, 5s], max_attempts: 3}}\n",
    "overhead.yml",
)


class _Channel:
    """What the consuming path calls on an aiormq channel; acks are counted, never sent."""

    def __init__(self) -> None:
        self.is_closed = False
        self.closing = asyncio.get_running_loop().create_future()
        self.on_consumer_cancel_callbacks: set[Any] = set()
        self.consumer: Callable[[DeliveredMessage], Awaitable[None]] | None = None
        self.acks: list[tuple[int, bool]] = []

    async def basic_ack(self, delivery_tag: int, multiple: bool = False,
                        wait: bool = True) -> None:
        self.acks.append((delivery_tag, multiple))

    @property
    def acked(self) -> int:
        """Deliveries the ack frames settled (a ``multiple`` one: every tag up to its own)."""
        top, alone = 0, set()
        for tag, multiple in self.acks:
            if multiple:
                top = max(top, tag)
            else:
                alone.add(tag)
        return top + sum(1 for tag in alone if tag > top)

    async def basic_qos(self, **kwargs: Any) -> None:
        return None

    async def basic_consume(self, queue: str, callback: Any, **kwargs: Any) -> Any:
        self.consumer = callback
        return SimpleNamespace(consumer_tag="ctag")

    async def basic_cancel(self, tag: str, **kwargs: Any) -> None:
        return None


class _Connection:
    def __init__(self) -> None:
        self.connection_tune = SimpleNamespace(frame_max=131072)
        self.server_properties = {"version": "3.10.8"}
        self.closing = asyncio.get_running_loop().create_future()
        # Sessions before 2026-11-23 took an aio-pika connection and read its aiormq one here:
        # kept so that older commits can be measured the same way.
        self.transport = SimpleNamespace(connection=self)

    async def channel(self, **kwargs: Any) -> _Channel:
        return _Channel()


class NoOp(RetryConsumer):
    queue = "q"
    prefetch = PREFETCH

    async def handle(self, delivery: Delivery) -> None:
        return None


def _message(channel: Any, i: int, flags: str | None = None) -> DeliveredMessage:
    """A first delivery; with ``flags``, carrying a producer's ``traceparent`` with them."""
    headers = None
    if flags is not None:
        headers = {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-{i + 1:016x}-{flags}"}
    properties = spec.Basic.Properties(
        content_type="application/json", delivery_mode=2, message_id=f"m-{i}", headers=headers
    )
    deliver = Basic.Deliver(
        consumer_tag="ctag", delivery_tag=i + 1, redelivered=False, exchange="", routing_key="q"
    )
    return DeliveredMessage(
        delivery=deliver,
        header=ContentHeader(0, 12, properties),
        body=b'{"order": 1}',
        channel=channel,
    )


async def _drive(
    channel: Any, callback: Callable[[], Any], n: int, flags: str | None = None
) -> float:
    """CPU microseconds per message to run ``n`` deliveries through ``callback()``."""
    loop = asyncio.get_running_loop()
    messages = [_message(channel, i, flags) for i in range(n)]
    slots = asyncio.Semaphore(PREFETCH)
    done = asyncio.Event()
    finished = 0

    def settled(_: Any) -> None:
        nonlocal finished
        slots.release()
        finished += 1
        if finished == n:
            done.set()

    start = time.process_time()
    for message in messages:
        await slots.acquire()
        loop.create_task(callback()(message)).add_done_callback(settled)
    await done.wait()
    return (time.process_time() - start) / n * 1e6


async def _ours(n: int, metrics: Metrics, flags: str | None = None,
                traced: bool = False) -> float:
    trace = None
    if traced:
        from rabbit_retry.worker.tracing import Tracing, trace_id

        trace = Tracing()
        metrics.keep_exemplars(trace_id)
    session = Session(_Connection(), subscribe([NoOp()], TOPOLOGY, metrics), "guest",  # type: ignore[arg-type]
                      *([trace] if traced else []))
    await session.start()
    streams = getattr(session, "streams", None)  # older commits: session.lanes
    channel = streams[0].lane.channel if streams else session.lanes[0].channel  # type: ignore[attr-defined]
    us = await _drive(channel, lambda: channel.consumer, n, flags)  # type: ignore[attr-defined]
    if streams:  # acks in groups: the last one goes out once the loop turns
        await streams[0].lane.settle.flush()
    assert channel.acked == n  # type: ignore[attr-defined]
    return us


async def _bare(n: int) -> float:
    channel = _Channel()

    async def on_message(message: DeliveredMessage) -> None:
        await channel.basic_ack(message.delivery.delivery_tag)  # type: ignore[union-attr,arg-type]

    return await _drive(channel, lambda: on_message, n)


def _sdk() -> bool:
    """The SDK as global tracer provider, when installed (the traced sides need it)."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )
    except ImportError:
        return False

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True  # set already (bench_tracing's)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    return True


TRACED = ("worker, traceparent, untraced", "worker, traced", "worker, traced, not sampled")


async def measure(n: int, rounds: int) -> dict[str, float]:
    names = ("bare callback", "worker", "worker, no metrics port")
    traced = _sdk()
    runs: dict[str, list[float]] = {name: [] for name in names + (TRACED if traced else ())}
    for _ in range(rounds):
        if traced:
            runs[TRACED[0]].append(await _ours(n, Metrics(), "01"))
            runs[TRACED[1]].append(await _ours(n, Metrics(), "01", traced=True))
            runs[TRACED[2]].append(await _ours(n, Metrics(), "00", traced=True))
        runs["bare callback"].append(await _bare(n))
        runs["worker"].append(await _ours(n, Metrics()))
        try:
            no_port = Metrics(exported=False)
        except TypeError:  # an older commit: no such option
            continue
        runs["worker, no metrics port"].append(await _ours(n, no_port))
    return {name: statistics.median(values) for name, values in runs.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    medians = asyncio.run(measure(args.messages, args.rounds))
    bare = medians["bare callback"]
    for name, us in medians.items():
        extra = f"  (+{us - bare:.1f} µs the worker adds)" if name != "bare callback" else ""
        print(f"{name:<26} {us:6.1f} µs CPU/msg{extra}")


if __name__ == "__main__":
    main()
