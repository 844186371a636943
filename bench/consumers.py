"""Our side of the benchmarks: RetryConsumer subclasses that ``rabbit-retry worker`` runs.

    rabbit-retry --url URL worker bench.consumers:RetryOnce -t topology.yml

Each handler does as little as its peer in the baselines: record with the probe, and fail when
the workload says so. The queue is always ``bench.work`` (the vhost changes per run) and the
prefetch comes from ``BENCH_PREFETCH`` so every system runs with the same one.
"""

from __future__ import annotations

import os

from bench.probe import QUEUE, probe
from rabbit_retry import Delivery, RetryConsumer

PREFETCH = int(os.environ.get("BENCH_PREFETCH", "50"))


class _Bench(RetryConsumer):
    queue = QUEUE
    prefetch = PREFETCH


class Noop(_Bench):
    """The success path: every message succeeds at once."""

    async def handle(self, delivery: Delivery) -> None:
        probe().done()


class RetryOnce(_Bench):
    """The retry path: the first attempt of every message fails, the second succeeds."""

    async def handle(self, delivery: Delivery) -> None:
        if delivery.attempt == 1:
            raise RuntimeError("bench: planned failure")
        probe().done()


class AlwaysFail(_Bench):
    """The retry storm: every attempt fails, so every message goes to the tier and waits."""

    async def handle(self, delivery: Delivery) -> None:
        probe().should_fail(delivery.message_id)
        raise RuntimeError("bench: planned failure")


class Peer(_Bench):
    """The peers' workload: messages flagged in the body fail once; latency from the body."""

    async def handle(self, delivery: Delivery) -> None:
        body = delivery.payload
        if probe().should_fail(body.get("id"), bool(body.get("fail"))):
            raise RuntimeError("bench: planned failure")
        probe().done(body.get("t"))
