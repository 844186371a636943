"""Our side of the benchmarks: RetryConsumer subclasses that ``rabbit-retry worker`` runs.

    rabbit-retry --url URL worker bench.consumers:RetryOnce -t topology.yml

Each handler does as little as its peer in the baselines: record with the probe, and fail when
the workload says so. The queue is always ``bench.work`` (the vhost changes per run) and the
prefetch comes from ``BENCH_PREFETCH`` so every system runs with the same one.
"""

from __future__ import annotations

import os
from typing import Any

from bench.probe import QUEUE, probe
from rabbit_retry import Batch, BatchResult, Delivery, RetryConsumer

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


# --- bench_batch: rows into PostgreSQL, one message at a time against batches -------------------

# Where bench_batch's consumers insert: a DSN and a table the benchmark creates per measurement.
PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_TABLE = os.environ.get("BENCH_PG_TABLE", "bench_rows")
PG_POOL = int(os.environ.get("BENCH_PG_POOL", "10"))
BATCH_SIZE = int(os.environ.get("BENCH_BATCH", "500"))
INSERT = f"insert into {PG_TABLE} (id, body) values (%s, %s) on conflict (id) do nothing"
# A batch as one statement: its ids and bodies as two arrays, unnested into rows.
INSERT_MANY = (f"insert into {PG_TABLE} (id, body) select * from unnest(%s::text[], %s::bytea[])"
               " on conflict (id) do nothing")


class _Postgres:
    """A psycopg connection pool opened with the worker and closed after it."""

    pool: Any = None
    pool_size = PG_POOL

    async def on_start(self) -> None:
        from psycopg_pool import AsyncConnectionPool

        self.pool = AsyncConnectionPool(PG_URL, min_size=self.pool_size,
                                        max_size=self.pool_size, open=False)
        await self.pool.open(wait=True)

    async def on_stop(self) -> None:
        await self.pool.close()


class PgInsert(_Postgres, _Bench):
    """One message, one row: an insert and its commit per message (``prefetch`` at once, over
    a pool of ``BENCH_PG_POOL`` connections)."""

    async def handle(self, delivery: Delivery) -> None:
        probe().should_fail(None)  # marks the first call: both systems are timed from it
        async with self.pool.connection() as connection:  # commits on the way out
            await connection.execute(INSERT, (delivery.message_id, delivery.body))
        probe().done()


class PgInsertBatch(_Postgres, RetryConsumer):
    """``BENCH_BATCH`` messages, one statement and its commit: the batch's ids and bodies sent
    as two arrays (``unnest``), as one would load many rows at once."""

    queue = QUEUE
    batch = Batch(size=BATCH_SIZE, wait=0.2)
    pool_size = 2  # the worker holds two batches: one fills while one is written

    async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
        probe().should_fail(None)
        async with self.pool.connection() as connection:  # commits on the way out
            await connection.execute(INSERT_MANY, ([d.message_id for d in deliveries],
                                                   [d.body for d in deliveries]))
        for _ in deliveries:
            probe().done()
        return None
