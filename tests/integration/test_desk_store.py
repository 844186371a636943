"""The desk's store on SQLite and on the real PostgreSQL server: migrations, ingest without
duplicates, groups, search, the actions' claims, leases, retention and counters."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pamqp import commands as spec
from support.desk import store_url

from rabbit_retry.desk import schema
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
    groups = store.groups()
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
    assert [g["count"] for g in store.groups(queue="payments")] == [1]


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
    store.insert([copy(i) for i in range(5)])
    group = copy(0).group
    assert store.discard(Selection(ids=(1, 2)), "ana", "known bad") == 2
    assert store.discard(Selection(ids=(1, 2)), "ana", "again") == 0  # not parked any more
    assert store.discard(Selection(group=group), "bo", "all of them") == 3
    assert store.status_counts() == {"discarded": 5}
    entries = store.audit()
    seen = [(e["actor"], e["action"], e["count"], e["reason"], e["selection"]) for e in entries]
    assert seen == [
        ("bo", "discard", 3, "all of them", {"group": group}),
        ("ana", "discard", 0, "again", {"ids": [1, 2]}),
        ("ana", "discard", 2, "known bad", {"ids": [1, 2]}),
    ]
    assert ("orders", "discarded", 5) in store.totals()


def test_a_replay_claims_settles_and_gives_back_refused_rows(store: Store) -> None:
    store.insert([copy(i) for i in range(6)])
    replay_id, claimed = store.start_replay(Selection(group=copy(0).group), "ana", "desk-a",
                                            to_queue=None, rate=None, lease=30)
    assert claimed == 6
    # Another action cannot take a claimed row.
    assert store.discard(Selection(ids=(1,)), "bo", "x") == 0
    assert store.start_replay(Selection(ids=(1,)), "bo", "desk-b", to_queue=None, rate=None,
                              lease=30)[1] == 0
    rows = store.replay_rows(replay_id, 0, 4)
    assert [r["id"] for r in rows] == [1, 2, 3, 4]
    assert [r["id"] for r in store.replay_rows(replay_id, 4, 4)] == [5, 6]
    store.settle_replayed(replay_id, [1, 2, 3, 4])
    store.unclaim(replay_id, [5, 6])
    assert store.finish_replay(replay_id, "2 not replayed: full") == 4
    assert store.status_counts() == {"replayed": 4, "parked": 2}
    entry = next(e for e in store.audit() if e["replay_id"] == replay_id)
    assert (entry["state"], entry["count"], entry["done_count"], entry["outcome"]) == (
        "failed", 6, 4, "2 not replayed: full")
    assert ("orders", "replayed", 4) in store.totals()


def test_a_replay_claims_its_rows_a_page_at_a_time(store: Store) -> None:
    store.insert([copy(i) for i in range(6)])
    replay_id, taken = store.start_replay(Selection(group=copy(0).group), "ana", "desk-a",
                                          to_queue="orders.v2", rate=None, lease=30)
    assert taken == 6
    assert store.status_counts() == {"parked": 6}  # taken, not yet claimed
    assert store.discard(Selection(group=copy(0).group), "bo", "x") == 0  # but held
    assert [r["id"] for r in store.replay_rows(replay_id, 0, 2)] == [1, 2]
    assert store.status_counts() == {"parked": 4, "replaying": 2}
    # A desk that died after claiming a page: the next one gets its rows again, as they are.
    assert [r["id"] for r in store.replay_rows(replay_id, 0, 2)] == [1, 2]
    store.settle_replayed(replay_id, [1, 2])
    # ... and once they are replayed, it goes on past them (not: an empty page, done).
    assert [r["id"] for r in store.replay_rows(replay_id, 0, 2)] == [3, 4]
    assert [r["id"] for r in store.replay_rows(replay_id, 4, 10)] == [5, 6]
    assert store.replay_rows(replay_id, 6, 10) == []
    store.settle_replayed(replay_id, [3, 4, 5, 6])
    assert store.finish_replay(replay_id, None) == 6
    assert store.status_counts() == {"replayed": 6}
    assert {r["replayed_to"] for r in store.messages(Query(status="replayed"))[1]} == {
        "orders.v2"}
    with store.engine.connect() as c:  # the replay let go of its rows
        assert c.execute(sa.select(sa.func.count()).select_from(schema.replay_items)
                         ).scalar_one() == 0


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_replay_running_at_the_upgrade_to_replay_items_keeps_its_rows(
        kind: str, tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    from rabbit_retry.desk.store import engine_url

    with store_url(kind, tmp_path) as url:
        engine = sa.create_engine(engine_url(url))
        config = Config()
        config.set_main_option("script_location",
                               str(Path(schema.__file__).parent / "migrations"))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0001")
        engine.dispose()
        old = Store(url)
        old.insert([copy(i) for i in range(3)])
        with old.engine.begin() as tx:  # what a replay's claim left under 0001
            tx.execute(schema.messages.update().values(status="replaying", replay_id="r1"))
            tx.execute(schema.replays.insert().values(id="r1", owner="gone", lease_until=T0))
        old.migrate()
        assert [r["id"] for r in old.replay_rows("r1", 0, 10)] == [1, 2, 3]
        assert old.discard(Selection(ids=(1,)), "bo", "x") == 0
        old.close()


def test_an_unfinished_replay_is_finished_only_once_its_lease_ran_out(store: Store) -> None:
    store.insert([copy(i) for i in range(3)])
    replay_id, _ = store.start_replay(Selection(ids=(1, 2, 3)), "ana", "desk-a", to_queue=None,
                                      rate=None, lease=30)
    assert store.take_abandoned("desk-b", 30) is None  # desk-a is alive
    assert store.renew(replay_id, "desk-a", 0.001)
    import time

    time.sleep(0.05)
    taken = store.take_abandoned("desk-b", 30)
    assert taken is not None and taken.id == replay_id
    assert store.take_abandoned("desk-c", 30) is None
    assert not store.renew(replay_id, "desk-a", 30)  # desk-a lost it
    assert len(store.replay_rows(replay_id, 0, 10)) == 3


def test_retention_removes_old_settled_rows_and_keeps_the_audit(store: Store) -> None:
    store.insert([copy(i) for i in range(4)])
    store.discard(Selection(ids=(1, 2)), "ana", "old")
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
