"""The outbox: the relay against a bare pipelined confirmed publish of the same messages, and
what ``Outbox.add`` costs an application's transaction.

Relay. N events (a JSON body, two headers, a content type; no order key, and in a second row
with order keys over 100 customers) are committed to a new outbox table while a relay runs
idle beside it, its broker connection open; the clock runs from the commit until the table says
every event is published. The baseline publishes the very same messages (bodies and properties
built before its clock starts) to the same queue with ``mandatory`` and publisher confirms, in
writes of ``BATCH`` messages (``broker.batch``, the leanest way we know) with ``DEPTH`` writes'
confirms in flight, on a connection opened before its clock, and does nothing else. Goal on
PostgreSQL: the relay >= 0.8x the baseline (unkeyed events).

Add. M transactions of an application, each inserting one order row through SQLAlchemy and
committing; the same with an ``Outbox.add`` of its event in each. The figure is transactions a
second, and what the add costs a transaction in microseconds.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiormq
import sqlalchemy as sa
from pamqp import commands as spec
from support.amqp import blocking, depth_sync
from support.outbox import migrated
from support.poll import eventually, wait_for
from support.provision import provision_sync
from support.stores import throwaway_postgres

from bench import common
from rabbit_retry.broker.batch import publish_batch
from rabbit_retry.outbox import Outbox
from rabbit_retry.outbox.event import outgoing
from rabbit_retry.outbox.relay import BATCH, DEPTH, Relay
from rabbit_retry.settings import Settings
from rabbit_retry.topology import parse_topology

QUEUE = "bench.outbox"
TOPOLOGY = f"""\
version: 1
exchanges:
  bench: {{type: topic}}
queues:
  {QUEUE}:
    queue_type: quorum
    bindings: [{{exchange: bench, routing_key: "order.*"}}]
"""
OURS = "rabbit-retry relay"
OURS_KEYED = "rabbit-retry relay, 100 order keys"
BARE = "bare pipelined confirmed publish"
PLAIN = "transaction without add"
WITH_ADD = "transaction with Outbox.add"


@contextmanager
def _database(kind: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="rr-bench-outbox-") as scratch:
            yield f"sqlite:///{Path(scratch) / 'app.db'}"
    else:
        with throwaway_postgres() as url:
            yield url


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


def _event(i: int, keyed: bool) -> dict[str, Any]:
    return {"exchange": "bench", "routing_key": "order.created",
            "body": json.dumps({"order": i, "amount_cents": i % 9973, "currency": "EUR"}),
            "message_id": f"o-{i}", "key": f"customer-{i % 100}" if keyed else None,
            "headers": {"tenant": "acme", "schema": 3}, "content_type": "application/json"}


# --- the relay -----------------------------------------------------------------------------------

async def _ours(settings: Settings, url: str, outbox: Outbox, n: int, keyed: bool) -> float:
    migrated(url)
    relay = Relay(url, outbox.topology, settings)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: relay.metrics.publishing == 1 or task.done(), within=60)
        if task.done():
            task.result()
        events = [_event(i, keyed) for i in range(n)]

        def commit() -> float:
            engine = _engine(url)
            try:
                with engine.connect() as conn:
                    for event in events:
                        outbox.add(conn, **event)
                    conn.commit()
                    return time.perf_counter()
            finally:
                engine.dispose()

        start = await asyncio.to_thread(commit)
        await eventually(lambda: relay.published == n or task.done(), within=3600,
                         interval=0.01)
        seconds = time.perf_counter() - start
        if task.done():
            task.result()
        return n / seconds
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=120)


async def _bare(settings: Settings, outbox: Outbox, n: int) -> float:
    messages = []
    for i in range(n):  # the very messages the relay sends, built before the clock
        event = outbox.event(**_event(i, False))
        messages.append(outgoing(event.message_id, event.body, event.headers, event.properties,
                                 None))
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        assert isinstance(channel, aiormq.Channel)
        window = asyncio.Semaphore(DEPTH)
        start = time.perf_counter()

        async def batch(part: list[tuple[bytes, spec.Basic.Properties]]) -> None:
            try:
                confirms = await publish_batch(channel, "order.created", part,
                                               exchange="bench")
                await asyncio.gather(*confirms)
            finally:
                window.release()

        tasks = []
        for at in range(0, n, BATCH):
            await window.acquire()
            tasks.append(asyncio.create_task(batch(messages[at:at + BATCH])))
        await asyncio.gather(*tasks)
        return n / (time.perf_counter() - start)
    finally:
        await connection.close()


# --- add -----------------------------------------------------------------------------------------

def _transactions(url: str, outbox: Outbox, m: int, with_add: bool) -> float:
    migrated(url)
    engine = _engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, "
                                 "customer TEXT, amount INTEGER)"))
        insert = sa.text("INSERT INTO orders VALUES (:id, :customer, :amount)")
        tag = "a" if with_add else "p"
        start = time.perf_counter()
        with engine.connect() as conn:
            for i in range(m):
                conn.execute(insert, {"id": f"{tag}-{i}", "customer": f"c-{i % 100}",
                                      "amount": i})
                if with_add:
                    outbox.add(conn, **_event(i, True))
                conn.commit()
        return m / (time.perf_counter() - start)
    finally:
        engine.dispose()


# --- run -----------------------------------------------------------------------------------------

def run(settings: Settings, *, n: int = 20_000, m: int = 5_000, runs: int = 3,
        kinds: tuple[str, ...] = ("postgresql", "sqlite"),
        log: Callable[[str], None] = common.say) -> dict[str, Any]:
    rows: list[list[Any]] = []
    plots = []
    headline: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rr-bench-outbox-") as scratch:
        path = Path(scratch) / "bench.yml"
        path.write_text(TOPOLOGY)
        outbox = Outbox(parse_topology(TOPOLOGY, str(path)))

        def relay(kind: str, system: str) -> float:
            with common.throwaway_vhost(settings, "outbox") as s:
                provision_sync(s, TOPOLOGY)
                if system == BARE:
                    rate = blocking(_bare(s, outbox, n), timeout=None)
                else:
                    with _database(kind) as url:
                        rate = blocking(_ours(s, url, outbox, n, system == OURS_KEYED),
                                        timeout=None)
                wait_for(lambda: depth_sync(s, QUEUE) == n, f"{n} in {QUEUE}")
                return rate

        def transactions(kind: str, with_add: bool) -> float:
            with _database(kind) as url:
                return _transactions(url, outbox, m, with_add)

        for kind in kinds:
            log(f"outbox relay ({kind}): {n:,} events x {runs} runs")
            samples = common.alternate(runs, {
                OURS: lambda k=kind: relay(k, OURS),
                BARE: lambda k=kind: relay(k, BARE),
                OURS_KEYED: lambda k=kind: relay(k, OURS_KEYED),
            }, log=log)
            ratio = common.median([common.ratio(a, b) for a, b in
                                   zip(samples[OURS], samples[BARE], strict=False)])
            goal = " (goal >= 0.8)" if kind == "postgresql" else ""
            headline[f"relay ratio ({kind})"] = f"{ratio:.2f}{goal}"
            keyed = common.median([common.ratio(a, b) for a, b in
                                   zip(samples[OURS_KEYED], samples[BARE], strict=False)])
            headline[f"relay ratio, 100 order keys ({kind})"] = f"{keyed:.2f}"
            for name, values in samples.items():
                rows.append([f"relay, {kind}", name, f"{common.median(values):,.0f} msg/s",
                             ", ".join(f"{v:,.0f}" for v in values)])
            plots.append(common.bars(f"Outbox relay, {kind}", "msg/s", samples))

            log(f"outbox add ({kind}): {m:,} transactions x {runs} runs")
            costs = common.alternate(runs, {
                PLAIN: lambda k=kind: transactions(k, False),
                WITH_ADD: lambda k=kind: transactions(k, True),
            }, log=log)
            plain, added = common.median(costs[PLAIN]), common.median(costs[WITH_ADD])
            extra = (1 / added - 1 / plain) * 1e6
            headline[f"add ({kind})"] = (f"{common.ratio(added, plain):.2f}x the transactions a "
                                         f"second; +{extra:,.0f} us a transaction")
            for name, values in costs.items():
                rows.append([f"add, {kind}", name, f"{common.median(values):,.0f} tx/s",
                             ", ".join(f"{v:,.0f}" for v in values)])
            plots.append(common.bars(f"Outbox.add in a transaction, {kind}", "tx/s", costs))
    return common.result(
        "Outbox: the relay against a bare pipelined confirmed publish, and the cost of add",
        ["what", "system", "median", "each run"],
        rows,
        headline=headline,
        notes=[
            f"Relay: {n:,} events committed at once, published to a quorum queue through a topic "
            f"exchange; the bare loop writes {BATCH} at a time and keeps {DEPTH * BATCH:,} "
            f"confirms in flight. Add: {m:,} transactions, one order row each (SQLAlchemy "
            f"Core, committed one by one). Median of {runs} alternating runs.",
        ],
        params={"n": n, "m": m, "runs": runs, "kinds": list(kinds)},
        plots=plots,
    )


if __name__ == "__main__":
    #   python -m bench.bench_outbox [runs] [n]: prints the result as JSON
    import sys

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    outcome = run(Settings(), runs=count, n=size)
    print(json.dumps({k: outcome[k] for k in ("headline", "rows", "notes") if k in outcome},
                     indent=2, default=str))
