"""The outbox against a real broker and database: events added in the application's own
transaction through every kind of connection ``add`` takes, published by a relay once committed
and never when rolled back; what the broker refuses failed with its reason, then dead; order per
key; several relays on PostgreSQL; retention; the relay's metrics and command line."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.amqp import drain, on_channel
from support.outbox import (
    claimable,
    migrated,
    out_of_order,
    outbox_store,
    relay_running,
    rows,
    statuses,
)
from support.poll import eventually, wait_for
from support.process import apply, cli
from support.stores import POSTGRES_URL

from rabbit_retry.broker.management import Management
from rabbit_retry.outbox import Outbox, UnknownDestination
from rabbit_retry.outbox.decide import RetryPolicy
from rabbit_retry.outbox.schema import history
from rabbit_retry.outbox.store import Failure, OutboxStore
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
  locked: {type: topic}
queues:
  shop.orders:
    queue_type: classic
    bindings: [{exchange: shop, routing_key: "order.*"}, {exchange: locked, routing_key: "#"}]
    retry: {delays: [1s], max_attempts: 2}
"""

# A PostgreSQL outbox's side is the same on every broker: tests/conftest.py runs the tests and
# parameters named for PostgreSQL on the newest broker only.
STORES = ["sqlite", "postgresql"]


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "shop.yml"
    path.write_text(TOPOLOGY)
    return path


@pytest.fixture
def topology(fresh_vhost: Settings, tmp_path: Path) -> Path:
    path = _file(tmp_path)
    apply(fresh_vhost, path)
    return path


def _sqlalchemy_url(url: str, driver: str = "psycopg") -> str:
    return url.replace("postgresql://", f"postgresql+{driver}://", 1)


# --- every kind of connection: committed published, rolled back never -----------------------

def _write_sqlite3(url: str, outbox: Outbox, events: list[dict[str, Any]], commit: bool) -> None:
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT)")
        for event in events:
            conn.execute("INSERT INTO orders VALUES (?)", (event["message_id"],))
            outbox.add(conn, **event)
        (conn.commit if commit else conn.rollback)()
    finally:
        conn.close()


def _write_sqlalchemy(url: str, outbox: Outbox, events: list[dict[str, Any]],
                      commit: bool) -> None:
    engine = sa.create_engine(_sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS orders (id TEXT)"))
            conn.commit()
            for event in events:
                conn.execute(sa.text("INSERT INTO orders VALUES (:id)"),
                             {"id": event["message_id"]})
                outbox.add(conn, **event)
            (conn.commit if commit else conn.rollback)()
    finally:
        engine.dispose()


def _write_session(url: str, outbox: Outbox, events: list[dict[str, Any]], commit: bool) -> None:
    from sqlalchemy.orm import Session

    engine = sa.create_engine(_sqlalchemy_url(url))
    try:
        with Session(engine) as session:
            for event in events:
                outbox.add(session, **event)
            (session.commit if commit else session.rollback)()
    finally:
        engine.dispose()


def _write_psycopg(url: str, outbox: Outbox, events: list[dict[str, Any]], commit: bool) -> None:
    import psycopg

    with psycopg.connect(url) as conn:
        for event in events:
            outbox.add(conn, **event)
        (conn.commit if commit else conn.rollback)()


def _write_psycopg_async(url: str, outbox: Outbox, events: list[dict[str, Any]],
                         commit: bool) -> None:
    import psycopg

    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            for event in events:
                await outbox.add_async(conn, **event)
            await (conn.commit if commit else conn.rollback)()

    asyncio.run(write())


def _write_sqlalchemy_async(url: str, outbox: Outbox, events: list[dict[str, Any]],
                            commit: bool, *, session: bool = False) -> None:
    """Through an ``AsyncConnection``, or with ``session`` an ``AsyncSession``."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def write() -> None:
        engine = create_async_engine(_sqlalchemy_url(url))
        try:
            async with AsyncSession(engine) if session else engine.connect() as conn:
                for event in events:
                    await outbox.add_async(conn, **event)
                await (conn.commit if commit else conn.rollback)()
        finally:
            await engine.dispose()

    asyncio.run(write())


Writer = Callable[[str, Outbox, list[dict[str, Any]], bool], None]
WRITERS: list[Any] = [
    pytest.param("sqlite", _write_sqlite3, id="sqlite3"),
    pytest.param("sqlite", _write_sqlalchemy, id="sqlalchemy-sqlite"),
    pytest.param("postgresql", _write_sqlalchemy, id="postgresql-sqlalchemy-connection"),
    pytest.param("postgresql", _write_session, id="postgresql-sqlalchemy-session"),
    pytest.param("postgresql", _write_sqlalchemy_async,
                 id="postgresql-sqlalchemy-async-connection"),
    pytest.param("postgresql", functools.partial(_write_sqlalchemy_async, session=True),
                 id="postgresql-sqlalchemy-async-session"),
    pytest.param("postgresql", _write_psycopg, id="postgresql-psycopg"),
    pytest.param("postgresql", _write_psycopg_async, id="postgresql-psycopg-async"),
]


def _events(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"exchange": "shop", "routing_key": "order.created",
             "body": json.dumps({"order": f"{prefix}-{i}"}).encode(),
             "message_id": f"{prefix}-{i}", "key": f"customer-{i % 2}",
             "headers": {"tenant": "acme", "amount": 0.1, "raw": b"\xff\x00"},
             "content_type": "application/json", "correlation_id": f"c-{prefix}-{i}"}
            for i in range(n)]


@pytest.mark.parametrize(("kind", "write"), WRITERS)
async def test_committed_events_are_published_once_and_rolled_back_ones_never(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, kind: str, write: Writer,
) -> None:
    outbox = Outbox(topology)
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        await asyncio.to_thread(write, url, outbox, _events("rolled-back", 2), False)
        await asyncio.to_thread(write, url, outbox, _events("committed", 3), True)
        assert statuses(url) == {"pending": 3}  # the rolled-back transaction left nothing
        async with relay_running(url, topology, fresh_vhost) as relay:
            await eventually(lambda: relay.published == 3, what="3 published")
        assert statuses(url) == {"published": 3}
        copies = await drain(fresh_vhost, "shop.orders")
    assert [c.message_id for c in copies] == ["committed-0", "committed-1", "committed-2"]
    first = copies[0]
    assert first.body == b'{"order": "committed-0"}'
    assert first.properties.content_type == "application/json"
    assert first.properties.correlation_id == "c-committed-0"
    assert first.properties.delivery_mode == 2
    assert first.headers == {"tenant": "acme", "amount": 0.1, "raw": b"\xff\x00"}


def test_an_unknown_destination_is_refused_and_nothing_is_written(
    topology: Path, tmp_path: Path,
) -> None:
    outbox = Outbox(topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    conn = sqlite3.connect(tmp_path / "app.db")
    with pytest.raises(UnknownDestination) as refused:
        outbox.add(conn, exchange="payments", routing_key="x", body=b"{}")
    assert str(refused.value) == (f"exchange 'payments' is not declared in {topology} (its "
                                  "exchanges: locked, shop); nothing was written")
    with pytest.raises(UnknownDestination, match=r"queue 'shop\.order' is not a queue of"):
        outbox.add(conn, queue="shop.order", body=b"{}")
    with pytest.raises(ValueError, match=r"give exchange= .* or queue=, not both"):
        outbox.add(conn, exchange="shop", queue="shop.orders", body=b"{}")
    with pytest.raises(TypeError, match="headers: cannot encode a set"):
        outbox.add(conn, exchange="shop", routing_key="order.x", body=b"{}",
                   headers={"bad": {1, 2}})
    # Positive control: the same connection writes a good event.
    outbox.add(conn, queue="shop.orders", body=b"{}", message_id="good")
    conn.commit()
    conn.close()
    assert [(r["exchange"], r["routing_key"], r["message_id"]) for r in rows(url)] == [
        ("", "shop.orders", "good")]


def test_a_connection_in_autocommit_mode_outside_a_transaction_is_refused(
    tmp_path: Path,
) -> None:
    outbox = Outbox(_file(tmp_path))
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    said = ("add: the Connection is in autocommit mode outside a transaction, so the event "
            "would commit on its own; add it inside the transaction of the writes it belongs "
            "with; nothing was written")
    conn = sqlite3.connect(tmp_path / "app.db", isolation_level=None)
    with pytest.raises(ValueError) as refused:
        outbox.add(conn, queue="shop.orders", body=b"", message_id="alone")
    assert str(refused.value) == said
    conn.execute("BEGIN")  # positive control: inside a transaction it is taken
    outbox.add(conn, queue="shop.orders", body=b"", message_id="in-a-transaction")
    conn.execute("COMMIT")
    conn.close()
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as auto, pytest.raises(ValueError, match="autocommit mode"):
        outbox.add(auto, queue="shop.orders", body=b"", message_id="sqlalchemy-alone")
    # A Session on that engine too (before, it was taken, and the event outlived a rollback).
    with Session(engine) as session, pytest.raises(ValueError) as refused:
        outbox.add(session, queue="shop.orders", body=b"", message_id="session-alone")
    assert str(refused.value) == said.replace("Connection", "Session")
    engine.dispose()
    assert [r["message_id"] for r in rows(url)] == ["in-a-transaction"]


def test_a_postgresql_psycopg_connection_in_autocommit_mode_needs_a_transaction_block(
    tmp_path: Path,
) -> None:
    import psycopg

    outbox = Outbox(_file(tmp_path))
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        with psycopg.connect(url, autocommit=True) as conn:
            with pytest.raises(ValueError, match="autocommit mode outside a transaction"):
                outbox.add(conn, queue="shop.orders", body=b"", message_id="alone")
            with conn.transaction():
                outbox.add(conn, queue="shop.orders", body=b"", message_id="in-a-block")
        assert [r["message_id"] for r in rows(url)] == ["in-a-block"]


# --- what the broker refuses -----------------------------------------------------------------

def _committed(url: str, outbox: Outbox, *events: dict[str, Any]) -> None:
    """``events`` added in one committed transaction (SQLAlchemy)."""
    engine = sa.create_engine(_sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            for event in events:
                outbox.add(conn, **event)
    finally:
        engine.dispose()
    claimable(url)


def _to(routing_key: str, message_id: str, key: str | None = None) -> dict[str, Any]:
    return {"exchange": "shop", "routing_key": routing_key, "body": message_id.encode(),
            "message_id": message_id, "key": key}


def _sequenced(i: int, key: str | None) -> dict[str, Any]:
    """Event ``i`` of a stream whose order ``support.outbox.out_of_order`` checks."""
    return {**_to("order.created", f"e-{i}", key), "body": json.dumps({"seq": i, "key": key})}


def _history(url: str, event_id: int) -> list[tuple[str, str | None]]:
    store = OutboxStore(url)
    try:
        found = store.event(event_id)
        assert found is not None
        return [(h["status"], h["detail"]) for h in found["history"]]
    finally:
        store.close()


@pytest.mark.parametrize("kind", STORES)
async def test_an_unroutable_event_fails_with_the_brokers_reason_then_dies_holding_its_key(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, kind: str,
) -> None:
    outbox = Outbox(topology)
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        # No queue takes "refund.created": the broker returns it.
        _committed(url, outbox, _to("refund.created", "lost", "k"),
                   _to("order.created", "held", "k"), _to("order.created", "free", "other"))
        retry = RetryPolicy(attempts=2, first_delay=0.2, max_delay=0.2)
        async with relay_running(url, topology, fresh_vhost, retry=retry) as relay:
            await eventually(lambda: statuses(url)["dead"] == 1, what="the unroutable dead")
            assert relay.published == 1
        # Positive control: the other key's event went out; the held one did not.
        assert [c.message_id for c in await drain(fresh_vhost, "shop.orders")] == ["free"]
        by_id = {r["message_id"]: r for r in rows(url)}
        assert (by_id["lost"]["status"], by_id["lost"]["attempts"]) == ("dead", 2)
        assert by_id["held"]["status"] == "pending"
        reason = ("unroutable: no queue bound to exchange 'shop' takes routing key "
                  "'refund.created' (the broker returned it: 312 NO_ROUTE)")
        assert by_id["lost"]["last_error"] == reason
        assert _history(url, by_id["lost"]["id"]) == [
            ("pending", "added"), ("failed", reason), ("failed", reason),
            ("dead", "failed 2 times")]
        # An operator discards it: the key moves on.
        store = OutboxStore(url)
        store.discard([by_id["lost"]["id"]], "ana", "sent to the wrong key")
        store.close()
        async with relay_running(url, topology, fresh_vhost) as relay:
            await eventually(lambda: relay.published == 1, what="the held event published")
        assert [c.message_id for c in await drain(fresh_vhost, "shop.orders")] == ["held"]
        assert _history(url, by_id["lost"]["id"])[-1] == ("discarded", "sent to the wrong key")


@pytest.mark.parametrize("kind", STORES)
async def test_in_continue_mode_a_failed_event_does_not_hold_its_key(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, kind: str,
) -> None:
    outbox = Outbox(topology)
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        _committed(url, outbox, _to("refund.created", "lost", "k"),
                   _to("order.created", "next", "k"))
        retry = RetryPolicy(attempts=1)
        async with relay_running(url, topology, fresh_vhost, retry=retry,
                                 on_failure="continue") as relay:
            await eventually(lambda: relay.published == 1, what="the next event published")
        assert statuses(url) == {"dead": 1, "published": 1}
        assert [c.message_id for c in await drain(fresh_vhost, "shop.orders")] == ["next"]


async def test_an_event_to_an_exchange_that_is_gone_fails_without_closing_the_channel(
    fresh_vhost: Settings, topology: Path, tmp_path: Path,
) -> None:
    outbox = Outbox(topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    await on_channel(fresh_vhost, lambda ch: ch.exchange_delete("locked"))
    conn = sqlite3.connect(tmp_path / "app.db")
    outbox.add(conn, exchange="locked", routing_key="x", body=b"1", message_id="nowhere")
    for i in range(20):
        outbox.add(conn, exchange="shop", routing_key="order.created", body=b"2",
                   message_id=f"ok-{i}")
    conn.commit()
    conn.close()
    async with relay_running(url, topology, fresh_vhost, retry=RetryPolicy(attempts=1)) as relay:
        await eventually(lambda: relay.published == 20 and statuses(url)["dead"] == 1,
                         what="20 published, 1 dead")
    [dead] = [r for r in rows(url) if r["status"] == "dead"]
    assert dead["last_error"] == (f"exchange 'locked' does not exist in vhost "
                                  f"{fresh_vhost.vhost!r} (apply the topology file to create it)")
    assert len(await drain(fresh_vhost, "shop.orders")) == 20


async def test_an_event_the_broker_closes_the_channel_over_is_failed_alone(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, management: Management,
) -> None:
    """The user may not write to exchange ``locked`` (ACCESS_REFUSED closes the channel): the
    events in flight beside it are published, that one fails with the broker's words."""
    path = f"/permissions/{quote(fresh_vhost.vhost, safe='')}/{quote(fresh_vhost.user, safe='')}"
    response = management.request("PUT", path, json={"configure": ".*", "read": ".*",
                                                     "write": "^(?!locked$).*"})
    assert response.status_code in (201, 204), response.text
    outbox = Outbox(topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    conn = sqlite3.connect(tmp_path / "app.db")
    for i in range(50):
        if i == 20:
            outbox.add(conn, exchange="locked", routing_key="x", body=b"!", message_id="locked")
        outbox.add(conn, exchange="shop", routing_key="order.created", body=b".",
                   message_id=f"ok-{i}")
    conn.commit()
    conn.close()
    async with relay_running(url, topology, fresh_vhost, retry=RetryPolicy(attempts=1)) as relay:
        # The relay counts a claim's events after the store has them: wait for both.
        await eventually(lambda: statuses(url) == {"published": 50, "dead": 1}
                         and relay.published == 50,
                         what="50 published (stored and counted), the locked one dead")
    [dead] = [r for r in rows(url) if r["status"] == "dead"]
    assert dead["message_id"] == "locked"
    assert dead["last_error"].startswith("the broker closed the channel: ACCESS_REFUSED")
    assert "exchange 'locked'" in dead["last_error"]
    copies = await drain(fresh_vhost, "shop.orders")
    assert {c.message_id for c in copies} == {f"ok-{i}" for i in range(50)}


# --- order, several relays, retention --------------------------------------------------------

@pytest.mark.parametrize("kind", STORES)
async def test_events_of_a_key_arrive_in_the_order_they_were_added(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, kind: str,
) -> None:
    outbox = Outbox(topology)
    n, keys = 600, 7
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        for start in range(0, n, 50):
            _committed(url, outbox, *(_sequenced(i, None if i % 5 == 0 else f"k{i % keys}")
                                      for i in range(start, start + 50)))
        async with relay_running(url, topology, fresh_vhost, batch=50, depth=3) as relay:
            await eventually(lambda: relay.published == n, what=f"{n} published")
        copies = await drain(fresh_vhost, "shop.orders")
    assert sorted(json.loads(c.body)["seq"] for c in copies) == list(range(n))
    assert out_of_order([c.body for c in copies]) == []


async def test_two_relays_on_one_postgresql_outbox_never_publish_an_event_twice(
    fresh_vhost: Settings, topology: Path, tmp_path: Path,
) -> None:
    outbox = Outbox(topology)
    n = 5000
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        _committed(url, outbox, *(_sequenced(i, f"k{i % 40}" if i % 2 else None)
                                  for i in range(n)))
        async with (relay_running(url, topology, fresh_vhost, batch=100) as one,
                    relay_running(url, topology, fresh_vhost, batch=100) as two):
            await eventually(lambda: one.published + two.published == n, within=120,
                             what=f"{n} published")
        # Positive control: both relays took part.
        assert one.published > 0 and two.published > 0, (one.published, two.published)
        copies = await drain(fresh_vhost, "shop.orders")
    ids = [c.message_id for c in copies]
    assert len(ids) == n and set(ids) == {f"e-{i}" for i in range(n)}
    assert out_of_order([c.body for c in copies]) == []


def _open_transaction(url: str, outbox: Outbox, *events: dict[str, Any],
                      write_first: bool = False) -> Any:
    """A psycopg connection whose transaction added ``events`` and is still open (the caller
    commits or rolls it back, and closes it). ``write_first``: it takes its transaction id at
    once (as a first write of its own would), before adding anything."""
    import psycopg

    conn = psycopg.connect(url)
    if write_first:
        conn.execute("SELECT pg_current_xact_id()")
    for event in events:
        outbox.add(conn, **event)
    return conn


def _status(url: str, message_id: str) -> str | None:
    return next((r["status"] for r in rows(url) if r["message_id"] == message_id), None)


def _claimed(url: str, store: OutboxStore | None = None) -> list[str]:
    """The message ids a claim takes now (released at once: nothing is published), by
    ``store`` or a store of its own."""
    own = store or OutboxStore(url)
    try:
        claim = own.claim(100)
        own.release(claim)
        return [r.message_id for r in claim.rows]
    finally:
        if store is None:
            own.close()


def test_on_postgresql_a_keys_event_waits_for_an_earlier_transaction_still_open(
    tmp_path: Path,
) -> None:
    """T1 adds e1 for key k and stays open; T2 adds e2 for k and commits: no claim takes e2
    while T1 runs (before revision 0002 the relay took it at once, and e1 after it). T1
    commits: e1, e2. The order is the transactions' ids' (taken at their first write), not the
    rows' ids: T3 took its id before T4, T4 added e3 first, T3 e4 after it; T4 committed
    first. Nothing of theirs goes out while T3 runs; then e4 (T3's), e3."""
    outbox = Outbox(_file(tmp_path))
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        t1 = _open_transaction(url, outbox, _to("order.created", "e1", "k"))
        t2 = _open_transaction(url, outbox, _to("order.created", "e2", "k"))
        t2.commit()
        assert _claimed(url) == []
        t1.commit()
        claimable(url)  # (transactions of tests beside this one)
        assert _claimed(url) == ["e1", "e2"]

        engine = sa.create_engine(_sqlalchemy_url(url))
        with engine.begin() as conn:  # as if published: out of the claims
            conn.execute(sa.text("UPDATE rabbit_retry_outbox SET status = 'published'"))
        engine.dispose()
        t3 = _open_transaction(url, outbox, write_first=True)
        t4 = _open_transaction(url, outbox, _to("order.created", "e3", "k"))
        outbox.add(t3, **_to("order.created", "e4", "k"))
        t4.commit()
        assert _claimed(url) == []
        t3.commit()
        claimable(url)
        assert _claimed(url) == ["e4", "e3"]
        for conn in (t1, t2, t3, t4):
            conn.close()


async def test_on_postgresql_the_relay_publishes_a_keys_events_in_transaction_order(
    fresh_vhost: Settings, topology: Path, tmp_path: Path,
) -> None:
    """The relay against the broker: T1 adds e1 for key k and stays open, T2 adds e2 for k and
    commits; T0, which took its transaction id before T1, adds ``before`` and commits after
    T2. Once the relay has published ``before`` (so it has looked since T2 committed) and
    stopped, e2 is still pending and nothing else arrived; after T1 commits, e1 then e2."""
    outbox = Outbox(topology)
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        t0 = _open_transaction(url, outbox, write_first=True)
        t1 = _open_transaction(url, outbox, _sequenced(1, "k"))
        t2 = _open_transaction(url, outbox, _sequenced(2, "k"))
        t2.commit()
        outbox.add(t0, **_to("order.created", "before"))
        t0.commit()
        try:
            async with relay_running(url, topology, fresh_vhost):
                await eventually(lambda: _status(url, "before") == "published",
                                 what="'before' published")
            # (e-1 is not committed yet: no one else sees it)
            assert {r["message_id"]: r["status"] for r in rows(url)} == {
                "before": "published", "e-2": "pending"}
            assert [c.message_id for c in await drain(fresh_vhost, "shop.orders")] == [
                "before"]
            t1.commit()
            async with relay_running(url, topology, fresh_vhost) as relay:
                await eventually(lambda: relay.published == 2, what="e-1 and e-2 published")
            copies = await drain(fresh_vhost, "shop.orders")
            assert [c.message_id for c in copies] == ["e-1", "e-2"]
            assert out_of_order([c.body for c in copies]) == []
        finally:
            for conn in (t0, t1, t2):
                conn.close()


def _added(url: str, outbox: Outbox, *events: dict[str, Any]) -> None:
    """``events`` added in one committed transaction (psycopg), not waited for."""
    conn = _open_transaction(url, outbox, *events)
    conn.commit()
    conn.close()


def _xids(url: str) -> dict[str, int]:
    """Each event's transaction id, by message id."""
    engine = sa.create_engine(_sqlalchemy_url(url))
    try:
        with engine.connect() as c:
            return {str(m): int(x) for m, x in c.execute(sa.text(
                "SELECT message_id, CAST(CAST(xid AS text) AS bigint) FROM rabbit_retry_outbox"))}
    finally:
        engine.dispose()


def _own_xid(conn: Any) -> int | None:
    """The id of the transaction open on ``conn`` (SQLAlchemy), if it has taken one."""
    found = conn.execute(sa.text(
        "SELECT CAST(CAST(pg_current_xact_id_if_assigned() AS text) AS bigint)")).scalar()
    return None if found is None else int(found)


def test_on_postgresql_a_claim_held_open_does_not_hold_back_events_added_after_it(
    tmp_path: Path,
) -> None:
    """Relay A's claim stays open (as while its events are published: up to the confirm
    deadline when the broker stalls) and holds a transaction id. Events committed after it can
    be claimed by relay B meanwhile (before, B took nothing newer than A's claim until it
    ended). The order still holds: an application's transaction W, open and holding an id,
    holds back what was added after it (``late``) until it ends; A's event is B's only once A
    lets go of it (as a relay that dies does)."""
    outbox = Outbox(_file(tmp_path))
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        _committed(url, outbox, _to("order.created", "first", "a"))
        a, b = OutboxStore(url), OutboxStore(url)
        held = a.claim(10)
        try:
            assert [r.message_id for r in held.rows] == ["first"]
            a_xid = _own_xid(held.connection)
            assert a_xid is not None  # its row locks gave A's claim a transaction id
            _added(url, outbox, _to("order.created", "early", "b"))
            w = _open_transaction(url, outbox, write_first=True)
            _added(url, outbox, _to("order.created", "late", "c"))
            xids = _xids(url)
            # Positive control: pg_snapshot_xmin alone stops at A's claim, below both events.
            assert a_xid < xids["early"] < xids["late"], (a_xid, xids)

            def claims() -> list[str]:
                return wait_for(lambda: _claimed(url, b), "B to claim an event", within=60)

            assert claims() == ["early"]  # not A's "first", not "late" (W holds it back)
            w.rollback()
            w.close()
            wait_for(lambda: _claimed(url, b) == ["early", "late"], "'late' claimed",
                     within=60)
            a.release(held)
            wait_for(lambda: _claimed(url, b) == ["first", "early", "late"],
                     "A's event claimed by B once A let go", within=60)
            assert b.sees_claims is True
        finally:
            a.release(held)
            a.close()
            b.close()


def test_on_postgresql_claims_that_cannot_read_pg_locks_wait_for_other_claims(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A relay whose role may not read ``pg_locks`` cannot tell other relays' claims from the
    application's transactions: it says so once and waits for every transaction older than an
    event, other relays' claims too (as before), never publishing out of order."""
    import uuid
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    outbox = Outbox(_file(tmp_path))
    role, password = f"rr_relay_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
            # pg_catalog's views are per database: this revokes it in the test's database only.
            admin.execute("REVOKE SELECT ON pg_catalog.pg_locks FROM PUBLIC")
            admin.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
            admin.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        parts = urlsplit(url)
        limited = urlunsplit(parts._replace(
            netloc=f"{role}:{password}@{parts.hostname}:{parts.port or 5432}"))
        a, b = OutboxStore(url), OutboxStore(limited)
        try:
            _committed(url, outbox, _to("order.created", "first", "a"))
            held = a.claim(10)
            assert [r.message_id for r in held.rows] == ["first"]
            _added(url, outbox, _to("order.created", "early", "b"))
            with caplog.at_level(logging.WARNING, logger="rabbit_retry.outbox"):
                assert _claimed(url, b) == []  # A's claim holds "early" back
            assert b.sees_claims is False
            assert caplog.text.count("cannot read pg_locks") == 1, caplog.text
            a.release(held)
            wait_for(lambda: _claimed(url, b) == ["first", "early"], "both claimed", within=60)
        finally:
            a.close()
            b.close()
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(f"DROP OWNED BY {role}")  # its grants in this database
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f"DROP ROLE IF EXISTS {role}")


async def test_on_postgresql_a_relay_publishes_while_another_relays_claim_is_held_open(
    fresh_vhost: Settings, topology: Path, tmp_path: Path,
) -> None:
    """Another relay's claim of e-1 (key k) stays open, as while a broker stalls its publishes.
    The relay publishes what was committed after it (``other``), but not e-2, k's next event,
    whose key the open claim has; once that claim lets go (its relay died), e-1 then e-2."""
    outbox = Outbox(topology)
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        _committed(url, outbox, _sequenced(1, "k"))
        elsewhere = OutboxStore(url)
        held = elsewhere.claim(10)
        try:
            assert [r.message_id for r in held.rows] == ["e-1"]
            _added(url, outbox, _sequenced(2, "k"), _to("order.created", "other", "o"))
            async with relay_running(url, topology, fresh_vhost) as relay:
                await eventually(lambda: _status(url, "other") == "published",
                                 within=60, what="'other' published")
                assert (_status(url, "e-1"), _status(url, "e-2")) == ("pending", "pending")
                await asyncio.to_thread(elsewhere.release, held)
                await eventually(lambda: relay.published == 3, within=60,
                                 what="e-1 and e-2 published")
            copies = await drain(fresh_vhost, "shop.orders")
            assert [c.message_id for c in copies] == ["other", "e-1", "e-2"]
            assert out_of_order([c.body for c in copies[1:]]) == []
        finally:
            elsewhere.release(held)
            elsewhere.close()


@pytest.mark.parametrize("kind", STORES)
def test_published_and_discarded_events_older_than_keep_are_removed_with_their_history(
    tmp_path: Path, kind: str,
) -> None:
    outbox = Outbox(_file(tmp_path))
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        _committed(url, outbox, *(_to("order.created", f"e-{i}") for i in range(6)))
        store = OutboxStore(url)
        old, new = datetime.now(UTC) - timedelta(days=2), datetime.now(UTC)
        claim = store.claim(2)
        e0, e1 = claim.rows
        store.settle(claim, [e0, e1], [], RetryPolicy(), "test", at=old)
        claim = store.claim(1)
        [e2] = claim.rows
        store.settle(claim, [e2], [], RetryPolicy(), "test", at=new)
        claim = store.claim(2)
        e3, e4 = claim.rows
        store.settle(claim, [], [Failure(e3, "no"), Failure(e4, "no")], RetryPolicy(attempts=1),
                     "test", at=old)
        store.discard([e3.id], "ana", "not needed", at=old)
        store.discard([e4.id], "ana", "not needed", at=new)
        assert store.sweep(timedelta(days=1)) == 3  # e0, e1 published and e3 discarded 2 days ago
        assert statuses(url) == {"published": 1, "discarded": 1, "pending": 1}
        with store.engine.connect() as c:
            kept = set(c.execute(sa.select(history.c.event_id)).scalars())
        assert kept == {e4.id}  # e3's history went with it
        assert store.sweep(timedelta(days=1)) == 0
        store.close()


# --- metrics and the command line --------------------------------------------------------------

async def test_the_relays_metrics_count_what_it_did_and_what_waits(
    fresh_vhost: Settings, topology: Path, tmp_path: Path,
) -> None:
    outbox = Outbox(topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    conn = sqlite3.connect(tmp_path / "app.db")
    for i in range(5):
        outbox.add(conn, exchange="shop", routing_key="order.created", body=b"", key="k",
                   message_id=f"e-{i}")
    outbox.add(conn, exchange="shop", routing_key="nowhere", body=b"", message_id="x")
    conn.commit()
    conn.close()
    async with relay_running(url, topology, fresh_vhost, metrics_port=0,
                             retry=RetryPolicy(attempts=1)) as relay:
        await eventually(lambda: relay.published == 5 and statuses(url)["dead"] == 1,
                         what="5 published, 1 dead")
        assert relay.metrics._server is not None
        port = relay.metrics._server.server_port
        text = (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/metrics")).text
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert series['rabbit_retry_outbox_published_total{destination="shop"}'] == 5
    assert series['rabbit_retry_outbox_failures_total{destination="shop"}'] == 1
    assert series['rabbit_retry_outbox_dead{destination="shop"}'] == 1
    assert series['rabbit_retry_outbox_pending{destination="shop"}'] == 0
    assert series['rabbit_retry_outbox_pending{destination="shop.orders"}'] == 0
    assert series['rabbit_retry_outbox_oldest_pending_seconds{destination="shop"}'] == 0
    assert series['rabbit_retry_outbox_publish_seconds_count{destination="shop"}'] == 5
    assert series["rabbit_retry_outbox_relay_publishing"] == 1
    assert series["rabbit_retry_outbox_relay_heartbeat_seconds"] > 0


def test_the_relay_command_refuses_bad_input_in_one_line(topology: Path, tmp_path: Path) -> None:
    ran = cli(None, "relay", "--store", "mysql://x/y", "-t", str(topology))
    assert (ran.code, ran.err.strip()) == (2, "error: --store: unsupported database 'mysql' in "
                                              "'mysql://x/y' (use sqlite:///PATH or "
                                              "postgresql://...)")
    ran = cli(None, "relay", "-t", str(topology), env={"RABBIT_RETRY_OUTBOX_STORE": ""})
    assert (ran.code, ran.err.strip()) == (
        2, "error: --store is required (or set RABBIT_RETRY_OUTBOX_STORE)")
    ran = cli(None, "relay", "--store", f"sqlite:///{tmp_path / 'a.db'}", "-t", str(topology),
              "--keep", "soon")
    assert ran.code == 2 and ran.err.startswith("error: --keep: "), ran.err
    ran = cli(None, "relay", "--store", f"sqlite:///{tmp_path / 'a.db'}", "-t", str(topology),
              "--no-migrate")
    assert (ran.code, ran.err.strip()) == (
        1, f"error: store sqlite:///{tmp_path / 'a.db'}: has no outbox tables; this relay needs "
           "revision 0002 (apply rabbit_retry/outbox/sql/*.sql, or start the relay without "
           "--no-migrate to migrate it)")
    with sqlite3.connect(tmp_path / "a.db") as c:  # --no-migrate made no table
        assert c.execute("SELECT name FROM sqlite_master").fetchall() == []


async def test_a_relay_whose_connection_the_broker_closes_reconnects_and_loses_nothing(
    fresh_vhost: Settings, topology: Path, tmp_path: Path, management: Management,
    caplog: pytest.LogCaptureFixture,
) -> None:
    outbox = Outbox(topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    added: list[str] = []

    def add(n: int) -> None:
        conn = sqlite3.connect(tmp_path / "app.db")
        for _ in range(n):
            added.append(outbox.add(conn, exchange="shop", routing_key="order.created",
                                    body=b"{}", key=f"k{len(added) % 3}"))
        conn.commit()
        conn.close()

    def relay_connections() -> list[str]:
        return [c["name"] for c in management.connections(fresh_vhost.vhost)
                if (c.get("client_properties") or {}).get("connection_name")
                == "rabbit-retry relay"]

    with caplog.at_level(logging.INFO, logger="rabbit_retry.outbox"):
        async with relay_running(url, topology, fresh_vhost) as relay:
            await asyncio.to_thread(add, 200)
            await eventually(lambda: relay.published == 200, what="200 published")
            # The statistics list a new connection within a few seconds.
            names = await eventually(lambda: relay_connections(), within=60,
                                     what="the relay's connection")
            for name in names:
                management.close_connection(name, reason="outbox test")
            await asyncio.to_thread(add, 300)
            await eventually(lambda: "broker back after" in caplog.text, within=60,
                             what="the relay to reconnect")
            await eventually(lambda: statuses(url) == {"published": 500},
                             what="500 published")
    said = caplog.text
    assert said.count("lost the broker") == 1 and said.count("broker back after") == 1, said
    assert "outbox test" in said  # the broker's reason, in the one line
    copies = await drain(fresh_vhost, "shop.orders")
    assert {c.message_id for c in copies} == set(added)
    assert len(copies) - len(added) <= 2000  # re-sent: at most what was in flight


# --- an operator's view and actions (what the failure desk shows and calls) --------------------

@pytest.mark.parametrize("kind", STORES)
def test_dead_events_are_listed_shown_with_their_history_retried_and_discarded(
    tmp_path: Path, kind: str,
) -> None:
    from rabbit_retry.outbox.view import shown

    outbox = Outbox(_file(tmp_path))
    with outbox_store(kind, tmp_path) as url:
        migrated(url)
        _committed(url, outbox, *({**_to("refund.created", f"d-{i}", "k"),
                                   "body": b"\xff" if i == 2 else f'{{"n": {i}}}',
                                   "headers": {"tenant": "acme"}} for i in range(3)),
                   {"queue": "shop.orders", "body": b"ok", "message_id": "alive"})
        store = OutboxStore(url)
        claim = store.claim(10, on_failure="continue")
        dead_rows = [r for r in claim.rows if r.message_id.startswith("d-")]
        store.settle(claim, [], [Failure(r, "unroutable: no queue") for r in dead_rows],
                     RetryPolicy(attempts=1), "relay-1")
        total, page = store.events(status="dead", limit=2)
        assert total == 3 and [r["message_id"] for r in page] == ["d-2", "d-1"]
        assert store.events(status="dead", text="d-0")[0] == 1
        assert store.events(status="dead", destination_name="shop.orders")[0] == 0
        one = store.event(page[0]["id"])
        assert one is not None
        view = shown(one)
        assert (view["destination"], view["status"], view["attempts"], view["error"]) == (
            "shop", "dead", 1, "unroutable: no queue")
        assert view["body_base64"] == "/w==" and view["headers"] == {"tenant": "acme"}
        assert [(h["status"], h["detail"], h["actor"]) for h in view["history"]] == [
            ("pending", "added", None), ("failed", "unroutable: no queue", "relay-1"),
            ("dead", "failed 1 times", "relay-1")]
        # An operator's actions take dead (or failed) events only, and say which they took.
        ids = [r["id"] for r in store.events(status="dead")[1]]
        alive = next(r["id"] for r in rows(url) if r["message_id"] == "alive")
        assert store.retry([ids[0], alive], "ana") == [ids[0]]
        assert store.discard([ids[0], ids[1]], "ana", "sent by mistake") == [ids[1]]
        assert store.retry([ids[1]], "ana") == []  # discarded: gone for good
        retried = store.event(ids[0])
        assert retried is not None
        assert (retried["status"], retried["attempts"]) == ("pending", 0)
        assert [(h["status"], h["detail"], h["actor"]) for h in retried["history"]][-1] == (
            "pending", "retried", "ana")
        store.close()
        assert statuses(url) == {"pending": 2, "dead": 1, "discarded": 1}


def test_plan_json_names_the_outbox_destinations(
    fresh_vhost: Settings, topology: Path, run_cli: Callable[..., Any],
) -> None:
    planned = run_cli("plan", str(topology), "--json", settings=fresh_vhost)
    assert planned.code == 0, planned.err
    assert json.loads(planned.out)["outbox_destinations"] == {
        "exchanges": ["locked", "shop"], "queues": ["shop.orders"]}
