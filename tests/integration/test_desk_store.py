"""The desk's store on SQLite and on the real PostgreSQL server: migrations, ingest without
duplicates, groups, search, the actions' claims, leases, retention and counters."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pamqp import commands as spec
from support.desk import store_url

from rabbit_retry.desk import schema
from rabbit_retry.desk.errors import NotFound, Nothing
from rabbit_retry.desk.ledger import Ledger
from rabbit_retry.desk.records import Parked, parked
from rabbit_retry.desk.store import Query, Selection, Store
from rabbit_retry.errors import InputError

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with store_url(str(request.param), tmp_path) as url:
        opened = Store(url)
        opened.migrate()
        yield opened
        opened.close()


def copy(i: int, *, queue: str = "orders", exc: str = "KeyError", msg: str | None = None,
         reason: str = "permanent", body: bytes | None = None, **headers: object) -> Parked:
    props = spec.Basic.Properties(
        message_id=f"m-{i}", correlation_id=f"c-{i % 3}",
        headers={"parked-reason": reason, "exception-type": exc,
                 "exception-message": msg if msg is not None else f"order {i} not found",
                 "parked-at": (T0 + dt.timedelta(minutes=i)).isoformat(), "retry-count": 1,
                 "tenant": f"t{i % 2}", **headers},
    )
    return parked(queue, body if body is not None else f'{{"order": {i}}}'.encode(), props,
                  now=T0)


def test_migrations_build_what_the_code_queries(store: Store) -> None:
    store.migrate()  # a second run changes nothing
    inspector = sa.inspect(store.engine)
    for table in schema.metadata.sorted_tables:
        live = {c["name"] for c in inspector.get_columns(table.name)}
        assert live == {c.name for c in table.columns}, table.name
        indexes = {i["name"] for i in inspector.get_indexes(table.name)}
        assert {i.name for i in table.indexes} <= indexes, table.name


def test_a_copy_is_stored_once_however_often_it_arrives(store: Store) -> None:
    batch = [copy(i) for i in range(10)]
    assert store.insert(batch) == 10
    assert store.insert([*batch[5:], copy(10)]) == 1
    assert store.status_counts() == {"parked": 11}
    assert ("orders", "ingested", 11) in store.totals()


def test_groups_count_one_cause_across_its_variable_parts(store: Store) -> None:
    store.insert([copy(i) for i in range(6)]
                 + [copy(100 + i, exc="TimeoutError", msg=f"timed out after {i}s",
                         reason="exhausted") for i in range(3)]
                 + [copy(200, queue="payments")])
    total, groups = store.groups()
    assert total == 3
    assert [(g["queue"], g["exception_type"], g["exception_message"], g["count"])
            for g in groups] == [
        ("orders", "KeyError", "order <n> not found", 6),
        ("orders", "TimeoutError", "timed out after <n>s", 3),
        ("payments", "KeyError", "order <n> not found", 1),
    ]
    first = groups[0]
    assert first["first_parked_at"] == T0
    assert first["last_parked_at"] == T0 + dt.timedelta(minutes=5)
    assert first["sample"] == "order 0 not found"
    assert [g["count"] for g in store.groups(queue="payments")[1]] == [1]
    # Paged, with the total and a filter on the cause.
    assert store.groups(limit=1, offset=1)[0] == 3
    assert [g["exception_type"] for g in store.groups(limit=1, offset=1)[1]] == ["TimeoutError"]
    assert [g["count"] for g in store.groups(text="timed out")[1]] == [3]
    assert store.groups(text="100%_")[0] == 0


def test_search_by_ids_header_body_time_and_status(store: Store) -> None:
    store.insert([copy(i) for i in range(20)] + [copy(50, body=b'{"sku": "50%_off"}')])

    def ids(**q: object) -> list[str]:
        total, rows = store.messages(Query(limit=100, **q))  # type: ignore[arg-type]
        assert total == len(rows)
        return sorted(r["message_id"] for r in rows)

    assert ids(text="m-7") == ["m-7"]
    assert ids(text="c-1") == sorted(f"m-{i}" for i in range(20) if i % 3 == 1)
    assert len(ids(text="tenant=t1")) == 10
    assert ids(text='"order": 13') == ["m-13"]
    assert ids(text="50%_off") == ["m-50"]  # LIKE's wildcards are matched literally
    assert ids(text="0_o") == [] and ids(text="%_o") == ["m-50"]
    assert ids(since=T0 + dt.timedelta(minutes=18)) == ["m-18", "m-19", "m-50"]
    assert ids(until=T0 + dt.timedelta(minutes=2)) == ["m-0", "m-1"]
    total, page = store.messages(Query(limit=5, offset=5))
    assert total == 21
    assert [r["message_id"] for r in page] == [f"m-{i}" for i in (15, 14, 13, 12, 11)]
    assert ids(status="discarded") == []


def test_discard_marks_parked_rows_and_writes_the_audit(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(5)])
    group = copy(0).group
    assert ledger.discard(Selection(ids=(1, 2)), "ana", "known bad") == 2
    # Nothing left to discard among them: said, and no audit entry.
    with pytest.raises(Nothing, match="nothing to discard: none of the 2 messages is parked "
                                      r"\(2 are discarded\)"):
        ledger.discard(Selection(ids=(1, 2)), "ana", "again")
    with pytest.raises(NotFound, match="no message 99"):
        ledger.discard(Selection(ids=(99,)), "ana", "again")
    assert ledger.discard(Selection(group=group), "bo", "all of them") == 3
    with pytest.raises(Nothing, match=f"nothing to discard: group {group} has no parked"):
        ledger.discard(Selection(group=group), "bo", "again")
    with pytest.raises(NotFound, match="no group 0123456789abcdef"):
        ledger.discard(Selection(group="0123456789abcdef"), "bo", "again")
    assert store.status_counts() == {"discarded": 5}
    entries = store.audit()
    seen = [(e["actor"], e["action"], e["count"], e["reason"], e["selection"]) for e in entries]
    assert seen == [
        ("bo", "discard", 3, "all of them", {"group": group}),
        ("ana", "discard", 2, "known bad", {"ids": [1, 2]}),
    ]
    assert ("orders", "discarded", 5) in store.totals()


def test_a_discarded_message_is_restored_and_its_history_says_who(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(3)])
    ledger.discard(Selection(ids=(1, 2)), "ana", "looked bad")
    with pytest.raises(Nothing, match="nothing to restore: message 3 is parked, not discarded"):
        ledger.restore(Selection(ids=(3,)), "bo", None)
    assert ledger.restore(Selection(ids=(1,)), "bo", "it was fine") == 1
    assert store.status_counts() == {"parked": 2, "discarded": 1}
    row = store.message(1)
    assert row is not None and (row["status"], row["discard_reason"]) == ("parked", None)
    found = store.history(1)
    assert found is not None
    rows, entries, events = found
    assert [r["id"] for r in rows] == [1]
    assert [(e["action"], e["actor"], e["reason"]) for e in entries] == [
        ("discard", "ana", "looked bad"), ("restore", "bo", "it was fine")]
    assert [m for m, _ in events] == [1, 1]


def test_a_replay_claims_settles_and_gives_back_refused_rows(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(6)])
    replay_id, claimed = ledger.start_replay(Selection(group=copy(0).group), "ana", "desk-a",
                                             to_queue=None, rate=None, lease=30)
    assert claimed == 6
    # Another action cannot take a claimed row, and says why.
    with pytest.raises(Nothing, match="message 1 is replaying, not parked"):
        ledger.discard(Selection(ids=(1,)), "bo", "x")
    with pytest.raises(Nothing):
        ledger.start_replay(Selection(ids=(1,)), "bo", "desk-b", to_queue=None, rate=None,
                            lease=30)
    rows = ledger.claim(replay_id, 0, 4).rows
    assert [r["id"] for r in rows] == [1, 2, 3, 4]
    assert [r["id"] for r in ledger.claim(replay_id, 4, 4).rows] == [5, 6]
    assert ledger.settle(replay_id, [1, 2, 3, 4]) == 4
    entry = store.audit_entry(replay_id)
    assert entry is not None and (entry["state"], entry["done_count"]) == ("running", 4)
    assert ledger.unclaim(replay_id, [5, 6]) == 2
    assert ledger.finish(replay_id, "failed", "2 not replayed: full") == 4
    assert store.status_counts() == {"replayed": 4, "parked": 2}
    entry = store.audit_entry(replay_id)
    assert entry is not None
    assert (entry["state"], entry["count"], entry["done_count"], entry["refused"],
            entry["outcome"], entry["detail"]) == (
        "failed", 6, 4, 2, "2 not replayed: full", {"queues": ["orders"]})
    assert ("orders", "replayed", 4) in store.totals()


def test_a_replay_claims_its_rows_a_page_at_a_time(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(6)])
    replay_id, taken = ledger.start_replay(Selection(group=copy(0).group), "ana", "desk-a",
                                           to_queue="orders.v2", rate=None, lease=30)
    assert taken == 6
    assert store.status_counts() == {"parked": 6}  # taken, not yet claimed
    with pytest.raises(Nothing):  # but held
        ledger.discard(Selection(group=copy(0).group), "bo", "x")
    assert [r["id"] for r in ledger.claim(replay_id, 0, 2).rows] == [1, 2]
    assert store.status_counts() == {"parked": 4, "replaying": 2}
    # A desk that died after claiming a page: the next one gets its rows again, as they are.
    assert [r["id"] for r in ledger.claim(replay_id, 0, 2).rows] == [1, 2]
    ledger.settle(replay_id, [1, 2])
    # ... and once they are replayed, it goes on past them (not: an empty page, done).
    assert [r["id"] for r in ledger.claim(replay_id, 0, 2).rows] == [3, 4]
    assert [r["id"] for r in ledger.claim(replay_id, 4, 10).rows] == [5, 6]
    assert ledger.claim(replay_id, 6, 10).rows == []
    ledger.settle(replay_id, [3, 4, 5, 6])
    assert ledger.finish(replay_id, "done", None) == 6
    assert store.status_counts() == {"replayed": 6}
    assert {r["replayed_to"] for r in store.messages(Query(status="replayed"))[1]} == {
        "orders.v2"}
    with store.engine.connect() as c:  # the replay let go of its rows
        assert c.execute(sa.select(sa.func.count()).select_from(schema.replay_items)
                         ).scalar_one() == 0


def _store_at(url: str, revision: str) -> sa.Engine:
    """A store migrated to ``revision`` only (an older desk's)."""
    from alembic import command
    from alembic.config import Config

    from rabbit_retry.desk.store import engine_url

    engine = sa.create_engine(engine_url(url))
    config = Config()
    config.set_main_option("script_location", str(Path(schema.__file__).parent / "migrations"))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    return engine


# The columns messages had before 0003 (what an older desk wrote).
_OLD_COLUMNS = [c for c in schema.messages.columns
                if c.name not in ("source", "replay_of", "grouping")]


_OLD_REPLAYS = sa.table("replays", sa.column("id"), sa.column("owner"),
                        sa.column("lease_until", schema.UtcDateTime()))


def _old_rows(engine: sa.Engine, copies: list[Parked], **values: object) -> None:
    table = sa.table("messages", *(sa.column(c.name, c.type) for c in _OLD_COLUMNS))
    rows = []
    for p in copies:
        row = {k: v for k, v in p.row().items() if k not in ("source", "replay_of", "grouping")}
        rows.append({**row, "ingested_at": T0, **values})
    with engine.begin() as tx:
        tx.execute(sa.table("groups", *(sa.column(c.name) for c in schema.groups.columns))
                   .insert(), list({p.group: p.group_row() for p in copies}.values()))
        tx.execute(table.insert(), rows)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_replay_running_at_the_upgrade_to_replay_items_keeps_its_rows(
        kind: str, tmp_path: Path) -> None:
    with store_url(kind, tmp_path) as url:
        engine = _store_at(url, "0001")
        # What a replay's claim left under 0001.
        _old_rows(engine, [copy(i) for i in range(3)], status="replaying", replay_id="r1")
        with engine.begin() as tx:
            tx.execute(_OLD_REPLAYS.insert().values(id="r1", owner="gone", lease_until=T0))
        engine.dispose()
        old = Store(url)
        old.migrate()
        assert [r["id"] for r in Ledger(old).claim("r1", 0, 10).rows] == [1, 2, 3]
        with pytest.raises(Nothing):
            Ledger(old).discard(Selection(ids=(1,)), "bo", "x")
        old.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_store_of_the_previous_desk_upgrades_in_place(kind: str, tmp_path: Path) -> None:
    """0002 -> 0003: rows, groups and a replay in progress carry over; rows grouped under the
    old built-in rules are regrouped (ids of letters and digits were one group each); the
    store gains the key that signs sessions."""
    with store_url(kind, tmp_path) as url:
        engine = _store_at(url, "0002")
        # Grouped as 0002's rules did: one group per sku.
        old_style = [copy(i, msg=f"'sku-AB{i:05d}'") for i in range(4)]
        old_style = [dataclasses.replace(p, group=f"{i:016x}", pattern=p.exception_message or "")
                     for i, p in enumerate(old_style)]
        _old_rows(engine, old_style)
        with engine.begin() as tx:
            tx.execute(sa.text("INSERT INTO audit (at, actor, action, count, selection, "
                               "replay_id, state) VALUES (:t, 'ana', 'replay', 1, '{}', 'r9', "
                               "'pending')"), {"t": T0.replace(tzinfo=None)})
            tx.execute(_OLD_REPLAYS.insert().values(id="r9", owner="gone", lease_until=T0))
            tx.execute(sa.text("INSERT INTO replay_items (message_id, replay_id) VALUES (4, 'r9')"))
        engine.dispose()
        store = Store(url)
        try:
            store.migrate()
            assert len(store.session_key()) == 32
            assert store.groups()[0] == 4  # as they were, until regrouped
            assert store.regroup() == 4
            total, groups = store.groups(status="parked")
            # One group under the new rules (the 4th, taken by the replay, is still parked).
            assert (total, [(g["exception_message"], g["count"]) for g in groups]) == (
                1, [("'sku-<id>'", 4)])
            assert store.regroup() == 0  # once
            entry = store.audit_entry("r9")
            assert entry is not None and entry["state"] == "running"
            taken = Ledger(store).take_abandoned("desk-new", 30)
            assert taken is not None and taken.id == "r9"
            assert [r["id"] for r in Ledger(store).claim("r9", 0, 10).rows] == [4]
        finally:
            store.close()


def test_an_unfinished_replay_is_finished_only_once_its_lease_ran_out(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(5)])
    replay_id, _ = ledger.start_replay(Selection(ids=(1, 2, 3, 4, 5)), "ana", "desk-a",
                                       to_queue=None, rate=None, lease=30)
    ledger.claim(replay_id, 0, 3)  # desk-a published 1-3 ...
    ledger.settle(replay_id, [1])  # ... and heard the broker confirm 1
    assert ledger.take_abandoned("desk-b", 30) is None  # desk-a is alive
    assert ledger.renew(replay_id, "desk-a", 0.001)
    import time

    time.sleep(0.05)
    taken = ledger.take_abandoned("desk-b", 30)
    # 2 and 3 may be out: desk-b re-sends them, and the audit counts them as it claims them.
    assert taken is not None and (taken.id, taken.resent) == (replay_id, 2)
    assert ledger.take_abandoned("desk-c", 30) is None
    assert not ledger.renew(replay_id, "desk-a", 30)  # desk-a lost it
    entry = store.audit_entry(replay_id)
    assert entry is not None and entry["resent"] is None
    assert [r["id"] for r in ledger.claim(replay_id, 0, 10).rows] == [2, 3, 4, 5]
    entry = store.audit_entry(replay_id)
    assert entry is not None and entry["resent"] == 2


def test_a_cancelled_replay_lets_go_of_what_it_had_not_claimed(store: Store) -> None:
    ledger = Ledger(store)
    store.insert([copy(i) for i in range(5)])
    replay_id, _ = ledger.start_replay(Selection(group=copy(0).group), "ana", "desk-a",
                                       to_queue=None, rate=None, lease=30)
    ledger.claim(replay_id, 0, 2)
    ledger.cancel(replay_id, "bo")
    ledger.cancel(replay_id, "carol")  # asked already: nothing more
    assert ledger.claim(replay_id, 2, 2).cancel_by == "bo"  # no more claims
    ledger.settle(replay_id, [1, 2])
    assert ledger.release(replay_id) == 3
    assert ledger.finish(replay_id, "cancelled", "cancelled by bo") == 2
    assert store.status_counts() == {"replayed": 2, "parked": 3}
    entry = store.audit_entry(replay_id)
    assert entry is not None
    assert (entry["state"], entry["cancelled_by"], entry["done_count"]) == ("cancelled", "bo", 2)
    with pytest.raises(Nothing, match=f"replay {replay_id} is not running \\(it is cancelled\\)"):
        ledger.cancel(replay_id, "bo")
    with pytest.raises(NotFound):
        ledger.cancel("0" * 32, "bo")


def test_retention_removes_old_settled_rows_and_keeps_the_audit(store: Store) -> None:
    store.insert([copy(i) for i in range(4)])
    Ledger(store).discard(Selection(ids=(1, 2)), "ana", "old")
    with store.engine.begin() as tx:
        tx.execute(schema.messages.update().where(schema.messages.c.id == 1)
                   .values(changed_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=31)))
    assert store.sweep(dt.timedelta(days=30)) == 1
    assert store.status_counts() == {"discarded": 1, "parked": 2}
    assert len(store.audit()) == 1


def test_store_urls_it_cannot_use_are_one_line() -> None:
    for url, says in (("mysql://x/y", "unsupported database 'mysql'"),
                      ("sqlite://", "needs a file"), ("not a url", "not a store URL")):
        with pytest.raises(InputError, match=says):
            Store(url)


def test_held_keys_are_the_parked_copies_that_carry_a_hold(store: Store) -> None:
    from rabbit_retry import contract

    store.insert([copy(1, **{contract.ORDERED_HOLD: "h-1", contract.ORDERED_KEY: "k-1"}),
                  copy(2),
                  copy(3, queue="mail", **{contract.ORDERED_HOLD: "h-3",
                                           contract.ORDERED_KEY: "k-3"}),
                  copy(4, **{contract.ORDERED_KEY: "k-4"})])
    by_queue, rows = store.held()
    assert by_queue == {"orders": 1, "mail": 1}
    assert [(r["queue"], r["key"], r["hold"], r["message_id"]) for r in rows] == [
        ("mail", "k-3", "h-3", "m-3"), ("orders", "k-1", "h-1", "m-1")]
    assert rows[1]["parked_at"] == T0 + dt.timedelta(minutes=1)
    assert store.held("orders")[0] == {"orders": 1}
    Ledger(store).discard(Selection(ids=(rows[1]["id"],)), "ana", "gone")
    assert store.held() == ({"mail": 1}, rows[:1])
