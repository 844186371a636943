"""Batch handlers: a consumer inserting each message as a row into PostgreSQL, one message at a
time against ``handle_batch`` at batch 500.

Both are ``rabbit-retry worker`` processes on the same queue type and the same backlog of
persistent messages, inserting into a table of their own throwaway database (``insert ... on
conflict do nothing``, so a redelivery is harmless). One at a time: ``bench.consumers:PgInsert``,
an insert and its commit per message, ``prefetch`` handlers at once over a pool of 10
connections. Batched: ``bench.consumers:PgInsertBatch``, one statement per batch (its ids and
bodies as two arrays, ``unnest``) and its commit, two batches held at once. The figure is rows
committed a second, first handler call to the N-th row; the aim is 5x.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.provision import provision_sync
from support.stores import throwaway_postgres

from bench import common
from bench.probe import QUEUE
from rabbit_retry.settings import Settings

GOAL = 5.0
TABLE = "bench_rows"


def _table(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"create table if not exists {TABLE} (id text primary key, body bytea)")
        connection.execute(f"truncate {TABLE}")


def _rows(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as connection:
        row = connection.execute(f"select count(*) from {TABLE}").fetchone()
    return int(row[0]) if row else 0


def run(
    settings: Settings,
    *,
    n: int = 50_000,
    runs: int = 3,
    batch: int = 500,
    prefetch: int = 50,
    queue_type: str = "quorum",
    timeout: float = 600.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    topology = common.queue_topology(QUEUE, delays=["5s"], max_attempts=3, queue_type=queue_type)

    def message(i: int) -> Any:
        return common.json_message({"id": i, "sku": f"sku-{i % 997}", "quantity": i % 7},
                                   message_id=str(i))

    with throwaway_postgres() as url:

        def measure(consumer: str) -> float:
            def setup(s: Settings) -> None:
                provision_sync(s, topology)
                _table(url)

            def argv(s: Settings, workdir: Path) -> list[str]:
                path = common.write_topology(workdir, topology)
                return common.rabbit_retry_cli("--url", s.url, "worker", consumer, "-t",
                                               str(path))

            drain = common.measure_drain(
                settings, f"batch-{consumer.rsplit(':', 1)[1].lower()}", setup=setup, argv=argv,
                n=n, make=message, queue=QUEUE, timeout=timeout,
                env={"BENCH_PREFETCH": str(prefetch), "BENCH_PG_URL": url,
                     "BENCH_PG_TABLE": TABLE, "BENCH_BATCH": str(batch)},
            )
            stored = _rows(url)
            if stored != n:  # nothing lost, nothing doubled: counted, not assumed
                raise RuntimeError(f"{consumer}: {stored} rows for {n} messages")
            return drain.rate

        systems = {
            f"handle_batch (batch {batch})": lambda: measure("bench.consumers:PgInsertBatch"),
            "handle (one at a time)": lambda: measure("bench.consumers:PgInsert"),
        }
        log(f"batch: {n:,} rows x {runs} runs")
        samples = common.alternate(runs, systems, log=log)
    notes = [
        f"{n:,} persistent JSON messages on a {queue_type} queue, each stored as one row in "
        "PostgreSQL (`insert ... on conflict (id) do nothing`, the body as bytea); median of "
        f"{runs} alternating runs; each worker in a process of its own, started after the "
        "backlog was published. The figure is rows a second from the first handler call to "
        "the N-th row (counted in the table after each run).",
        f"One at a time: `handle`, one insert and its commit per message, prefetch {prefetch} "
        "over a pool of 10 connections. Batched: `handle_batch` with `Batch(size="
        f"{batch}, wait=0.2)`, one `insert ... select * from unnest(ids, bodies)` and its "
        "commit per batch, the default prefetch (two batches).",
    ]
    return common.throughput_result(
        f"Batch handler: rows into PostgreSQL, batch {batch} against one at a time",
        samples,
        ours=f"handle_batch (batch {batch})",
        baseline="handle (one at a time)",
        unit="rows/s",
        goal=GOAL,
        notes=notes,
        params={"n": n, "runs": runs, "batch": batch, "prefetch": prefetch,
                "queue_type": queue_type},
    )
