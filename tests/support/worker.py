"""The worker under test in the test's own event loop (test-only)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from rabbit_retry import metric_names
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology
from rabbit_retry.worker import RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics

from .poll import eventually


@contextlib.asynccontextmanager
async def running(
    consumers: Sequence[RetryConsumer],
    topo: Topology,
    settings: Settings,
    *,
    grace: float = 5.0,
    metrics_port: int | None = None,
) -> AsyncIterator[Runner]:
    """Run a worker in this event loop for the duration of the block."""
    runner = Runner(
        consumers,
        topology=topo,
        settings=settings,
        grace=grace,
        metrics=Metrics(),
        metrics_port=metrics_port,
    )
    task = asyncio.create_task(runner.run())
    try:
        await eventually(
            lambda: runner.ready.is_set() or task.done(), within=30, what="worker ready"
        )
        if task.done():
            task.result()  # raises the startup error
        yield runner
    finally:
        runner.stop()
        await asyncio.wait_for(task, timeout=60)


def scraped(runner: Runner, series: metric_names.Series, *labels: str) -> float:
    """One sample of ``series`` as Prometheus would scrape it from ``runner`` (0 if absent)."""
    value = runner.metrics.registry.get_sample_value(series.name, dict(zip(series.labels, labels,
                                                                            strict=True)))
    return 0.0 if value is None else value


def run_until_parked(
    consumers: Sequence[RetryConsumer], topo: Topology, settings: Settings, queue: str,
    count: int, *, within: float = 120.0,
) -> None:
    """From synchronous code: run a worker until ``queue``'s parking queue holds ``count``
    messages, then stop it."""
    from .amqp import blocking, depth

    async def parked() -> bool:
        return await depth(settings, f"{queue}.parking") == count

    async def work() -> None:
        async with running(consumers, topo, settings):
            await eventually(parked, within=within, what=f"{count} parked in {queue}.parking")

    blocking(work(), timeout=within + 60)
