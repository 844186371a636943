"""The failure desk: ingest against a bare consume-and-insert loop, a group replay against a
pipelined confirmed-publish loop, and how fast its API answers over a million stored rows.

Ingest. N parked messages wait in ``Q.parking``. Ours is ``desk.ingest.Ingest`` (what
``rabbit-retry desk`` runs): rows with digest, group and JSON views, one transaction per batch,
then one ``basic.ack(multiple)``. The baseline is the leanest loop that is still safe: consume
with the same prefetch, insert (body, headers as JSON) rows in batches of the same size in one
transaction each, commit, ack the batch. Both write to the same kind of store (a new SQLite file,
or a new PostgreSQL database); the goal is ours >= 0.5x.

Replay. N rows of one group in the store; ours is ``desk.actions.Actions.replay`` of the group
(take the rows with the audit entry, claim and read them a page at a time, build each copy's
replay headers, publish with ``mandatory`` and confirms, mark replayed); the baseline publishes
the same bodies and headers, built before its clock starts, to the same queue, ``WINDOW``
confirms in flight, and does nothing else. Both have their connection open before the clock
starts (a desk keeps its own across replays). Goal >= 0.8x.

Pages. ``rows`` rows (a million in a full run) in an SQLite store, 40 groups over 2 queues:
the time the API takes for what the page asks (median of 5 requests each).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiormq
import sqlalchemy as sa
from pamqp import commands as spec
from support.amqp import blocking, depth_sync
from support.parked import Parked, park
from support.poll import wait_for
from support.provision import provision_sync
from support.stores import throwaway_postgres

from bench import common
from rabbit_retry.contract import republish_properties
from rabbit_retry.desk.actions import WINDOW, Actions
from rabbit_retry.desk.ingest import BATCH, Ingest
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.store import Selection, Store
from rabbit_retry.parking.headers import replay_headers
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming

QUEUE = "bench.desk"
OURS_INGEST = "rabbit-retry desk ingest"
BARE_INGEST = "bare consume-and-insert loop"
OURS_REPLAY = "rabbit-retry desk group replay"
BARE_REPLAY = "bare pipelined confirmed publish"


def _parked(n: int) -> list[Parked]:
    return [Parked(json.dumps({"order": i, "amount": i % 997}).encode(),
                   exception_type="TimeoutError", message_id=f"b-{i}",
                   headers={"exception-message": f"gateway timed out after {i % 30}s"})
            for i in range(n)]


@contextmanager
def _store_url(kind: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="rr-bench-desk-") as scratch:
            yield f"sqlite:///{Path(scratch) / 'desk.db'}"
    else:
        with throwaway_postgres() as url:
            yield url


# --- ingest ------------------------------------------------------------------------------------


async def _ours_ingest(settings: Settings, url: str, n: int) -> float:
    store = Store(url)
    store.migrate()
    ingest = Ingest(store, settings, [QUEUE])
    start = time.perf_counter()
    task = asyncio.create_task(ingest.run())
    try:
        while ingest.stats.seen < n:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return n / (time.perf_counter() - start)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


async def _bare_ingest(settings: Settings, url: str, n: int) -> float:
    store = Store(url)  # the engine only: a table of its own, no migrations, no indexes
    table = sa.Table("bare", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                     sa.Column("headers", sa.Text), sa.Column("body", sa.LargeBinary))
    table.create(store.engine)
    connection = await aiormq.connect(settings.url)
    got: list[aiormq.abc.DeliveredMessage] = []
    arrived = asyncio.Event()
    done = 0
    start = time.perf_counter()
    try:
        channel = await connection.channel()
        await channel.basic_qos(prefetch_count=4 * BATCH)

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            got.append(message)
            arrived.set()

        await channel.basic_consume(naming.parking_queue(QUEUE), on_message)
        while done < n:
            await arrived.wait()
            batch, got[:] = got[:BATCH], got[BATCH:]
            if not got:
                arrived.clear()
            rows = [{"headers": json.dumps(m.header.properties.headers, default=str),
                     "body": m.body} for m in batch]

            def insert(rows: list[dict[str, Any]] = rows) -> None:
                with store.engine.begin() as tx:
                    tx.execute(table.insert(), rows)

            await asyncio.to_thread(insert)
            last = batch[-1].delivery
            assert isinstance(last, spec.Basic.Deliver)
            await channel.basic_ack(last.delivery_tag, multiple=True)
            done += len(batch)
        return n / (time.perf_counter() - start)
    finally:
        await connection.close()
        store.close()


# --- replay ------------------------------------------------------------------------------------


def _filled_store(url: str, n: int) -> tuple[Store, str]:
    store = Store(url)
    store.migrate()
    now = datetime.now(UTC)
    copies = [parked(QUEUE, p.body, spec.Basic.Properties(
        headers=p.amqp_headers(QUEUE), message_id=p.message_id, delivery_mode=2), now=now)
        for p in _parked(n)]
    for i in range(0, n, BATCH):
        store.insert(copies[i:i + BATCH])
    return store, copies[0].group


async def _ours_replay(settings: Settings, url: str, n: int) -> float:
    store, group = await asyncio.to_thread(_filled_store, url, n)
    actions = Actions(store, settings, {QUEUE})
    try:
        await actions.connect()  # a desk keeps its connection; the baseline's opens off the clock
        start = time.perf_counter()
        _, task = await actions.replay(Selection(group=group), "bench")
        result = await task
        seconds = time.perf_counter() - start
        assert result.replayed == n, result
        return n / seconds
    finally:
        await actions.close()
        store.close()


async def _bare_replay(settings: Settings, n: int) -> float:
    # The very copies ours publishes (replay headers, same properties), built before the clock.
    bodies = []
    for p in _parked(n):
        headers = replay_headers(p.amqp_headers(QUEUE))
        headers["replay-id"] = "0" * 32
        source = spec.Basic.Properties(message_id=p.message_id, delivery_mode=2)
        bodies.append((p.body, republish_properties(source, headers, settings.user)))
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        window = asyncio.Semaphore(WINDOW)
        start = time.perf_counter()

        async def one(body: bytes, properties: spec.Basic.Properties) -> None:
            try:
                await channel.basic_publish(body, routing_key=QUEUE, properties=properties,
                                            mandatory=True)
            finally:
                window.release()

        tasks = []
        for body, properties in bodies:
            await window.acquire()
            tasks.append(asyncio.create_task(one(body, properties)))
        await asyncio.gather(*tasks)
        return n / (time.perf_counter() - start)
    finally:
        await connection.close()


# --- pages -------------------------------------------------------------------------------------


def _million(url: str, rows: int) -> Store:
    """``rows`` rows, written straight into the table (the ingest path is measured above)."""
    store = Store(url)
    store.migrate()
    now = datetime.now(UTC)
    templates = []
    for g in range(40):
        queue = f"q{g % 2}"
        props = spec.Basic.Properties(message_id="x", headers={
            "parked-reason": "exhausted", "exception-type": f"Error{g}",
            "exception-message": f"cause {g} failed for order 1", "retry-count": 3})
        templates.append(parked(queue, b'{"order": 1}', props, now=now))
    with store.engine.begin() as tx:
        tx.execute(sa.text("DELETE FROM messages"))
    from rabbit_retry.desk.schema import groups, messages

    with store.engine.begin() as tx:
        tx.execute(groups.insert(), [t.group_row() for t in templates])
    chunk = 20_000
    for start in range(0, rows, chunk):
        batch = []
        for i in range(start, min(rows, start + chunk)):
            t = templates[i % 40]
            row = t.row()
            row.update(digest=uuid.uuid4().hex, message_id=f"m-{i}", correlation_id=f"c-{i}",
                       parked_at=now - timedelta(seconds=rows - i), ingested_at=now,
                       body_text=f'{{"order": {i}}}')
            batch.append(row)
        with store.engine.begin() as tx:
            tx.execute(messages.insert(), batch)
    return store


def _page_times(store: Store, rows: int) -> list[list[str]]:
    from fastapi.testclient import TestClient

    from rabbit_retry.desk.app import Desk, create_app

    desk = Desk(store, Actions(store, Settings.from_env(None, None), {"q0", "q1"}),
                ["q0", "q1"], None)
    client = TestClient(create_app(desk), base_url="http://127.0.0.1")  # a Host the desk serves
    group = client.get("/api/groups").json()[0]["id"]
    asks = {
        "overview (counts by queue and reason)": "/api/overview",
        "groups, parked": "/api/groups",
        "messages, first page": "/api/messages?status=parked&limit=50",
        "messages, page 1,000": "/api/messages?status=parked&limit=50&offset=49950",
        "messages of one group": f"/api/messages?group={group}&limit=50",
        "search by message id": f"/api/messages?q=m-{rows // 2}",
        "search in bodies": f'/api/messages?q="order": {rows - 7}',
        "one message": "/api/messages/1",
        "/metrics": "/metrics",
    }
    out = []
    for label, path in asks.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, (path, response.text[:200])
        out.append([label, f"{statistics.median(times):,.0f}"])
    return out


# --- run ---------------------------------------------------------------------------------------


def run(settings: Settings, *, n: int = 100_000, replay_n: int = 10_000, rows: int = 1_000_000,
        runs: int = 3, kinds: tuple[str, ...] = ("sqlite", "postgresql"),
        parts: tuple[str, ...] = ("ingest", "replay", "pages"),
        log: Callable[[str], None] = common.say) -> dict[str, Any]:
    topology = common.queue_topology(QUEUE, delays=["1m"], max_attempts=2, queue_type="quorum")
    parking = naming.parking_queue(QUEUE)
    rows_out: list[list[Any]] = []
    plots = []
    headline: dict[str, Any] = {}

    def ingest(kind: str, ours: bool) -> float:
        with common.throwaway_vhost(settings, "desk-ingest") as s, _store_url(kind) as url:
            provision_sync(s, topology)
            blocking(park(s, QUEUE, _parked(n)), timeout=None)
            rate = blocking(_ours_ingest(s, url, n) if ours else _bare_ingest(s, url, n),
                            timeout=None)
            wait_for(lambda: depth_sync(s, parking) == 0, "the parking queue emptied")
            return rate

    def replay(kind: str, ours: bool) -> float:
        with common.throwaway_vhost(settings, "desk-replay") as s, _store_url(kind) as url:
            provision_sync(s, topology)
            rate = blocking(_ours_replay(s, url, replay_n) if ours else _bare_replay(s, replay_n),
                            timeout=None)
            wait_for(lambda: depth_sync(s, QUEUE) == replay_n, f"{replay_n} replayed")
            return rate

    def compare(label: str, size: int, goal: float, ours: str, bare: str,
                measure: Callable[[str, bool], float], kind: str) -> None:
        log(f"desk {label} ({kind}): {size:,} x {runs} runs")
        samples = common.alternate(runs, {ours: lambda: measure(kind, True),
                                          bare: lambda: measure(kind, False)}, log=log)
        ratio = common.median([common.ratio(a, b) for a, b in
                               zip(samples[ours], samples[bare], strict=False)])
        headline[f"{label} ratio ({kind})"] = f"{ratio:.2f} (goal >= {goal})"
        for name, values in samples.items():
            rows_out.append([f"{label}, {kind}", name, f"{common.median(values):,.0f}",
                             ", ".join(f"{v:,.0f}" for v in values)])
        plots.append(common.bars(f"Desk {label}, {kind}", "msg/s", samples))

    for kind in kinds:
        if "ingest" in parts:
            compare("ingest", n, 0.5, OURS_INGEST, BARE_INGEST, ingest, kind)
        if "replay" in parts:
            compare("replay", replay_n, 0.8, OURS_REPLAY, BARE_REPLAY, replay, kind)
    notes = [
        f"Ingest: {n:,} parked messages (JSON body, parking headers with a stack trace) per "
        f"run; replay: {replay_n:,} rows of one group to a quorum queue. Median of {runs} "
        "alternating runs each; every run ends with the queues counted (nothing left behind).",
    ]
    if "pages" in parts:
        log(f"desk pages over {rows:,} rows (SQLite)")
        with _store_url("sqlite") as url:
            started = time.perf_counter()
            store = _million(url, rows)
            filled = time.perf_counter() - started
            try:
                pages = _page_times(store, rows)
            finally:
                store.close()
        notes.append(f"API over {rows:,} rows in SQLite (written in {filled:.0f} s), median of "
                     "5 requests, in-process (no network): "
                     + "; ".join(f"{label} {ms} ms" for label, ms in pages))
    return common.result(
        "Failure desk: ingest, group replay, pages over a million rows",
        ["what", "system", "median msg/s", "each run"],
        rows_out,
        headline=headline,
        notes=notes,
        params={"n": n, "replay_n": replay_n, "rows": rows, "runs": runs, "kinds": list(kinds),
                "parts": list(parts)},
        plots=plots,
    )


if __name__ == "__main__":
    # One part on its own, e.g. the replay after a change to it:
    #   python -m bench.bench_desk replay 5   (part, runs); prints the result as JSON
    import sys

    part = sys.argv[1] if len(sys.argv) > 1 else "replay"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    outcome = run(Settings(), parts=(part,), runs=count)
    print(json.dumps({k: outcome[k] for k in ("headline", "rows", "notes") if k in outcome},
                     indent=2, default=str))
    if part == "replay":  # the full run's plots 1 and 3 (0 and 2 are the ingest's)
        from bench.run import _plot

        for index, spec in zip((1, 3), outcome["plots"], strict=True):
            _plot(spec, common.REPO / "docs" / f"benchmarks-desk-{index}.png")
