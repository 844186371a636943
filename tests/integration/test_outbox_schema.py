"""The outbox's schema three ways, one schema: what the relay's Alembic migrations make, what
``rabbit_retry/outbox/sql/*.sql`` makes for teams that manage their own, and the tables the code
queries (``outbox.schema``, with PostgreSQL's own ``xid`` column and indexes), on SQLite and
PostgreSQL. A relay finds a database made from the SQL file up to date (and ``--no-migrate``
accepts it), its migration lives beside the application's own Alembic history without touching
it, and a database of revision 0001 upgrades with its events."""

from __future__ import annotations

import sqlite3
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.outbox import claimable, migrated, outbox_store

from rabbit_retry.outbox import Outbox
from rabbit_retry.outbox.schema import POSTGRESQL_COLUMNS, POSTGRESQL_INDEXES, metadata
from rabbit_retry.outbox.store import HEAD, OutboxStore

STORES = ["sqlite", "postgresql"]


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


def _run_sql_file(url: str, kind: str, name: str | None = None) -> None:
    script = (resources.files("rabbit_retry.outbox") / "sql" / f"{name or kind}.sql").read_text()
    if kind == "sqlite":
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.executescript(script)
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script.encode())  # several statements, no parameters: one simple query


def _shape(url: str) -> dict[str, Any]:
    """Every table, column, index and primary key, as the database reports them."""
    engine = _engine(url)
    try:
        inspector = sa.inspect(engine)
        shape: dict[str, Any] = {}
        for table in sorted(inspector.get_table_names()):
            with warnings.catch_warnings():  # SQLAlchemy has no type of its own for xid8
                warnings.filterwarnings("ignore", "Did not recognize type 'xid8'")
                found = inspector.get_columns(table)
            columns = [(c["name"], str(c["type"]), c["nullable"],
                        str(c.get("default") or "").replace("'::character varying", "'"))
                       for c in found]
            indexes = sorted(
                (i["name"], tuple(i["column_names"]), bool(i["unique"]),
                 " ".join(str((i.get("dialect_options") or {}).get(
                     f"{engine.dialect.name}_where", "")).split()))
                for i in inspector.get_indexes(table))
            key = inspector.get_pk_constraint(table)["constrained_columns"]
            shape[table] = {"columns": columns, "indexes": indexes, "primary_key": key}
        return shape
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", STORES)
def test_the_migration_and_the_sql_file_make_the_same_tables_as_the_code_queries(
    tmp_path: Path, kind: str,
) -> None:
    with outbox_store(kind, tmp_path / "a") as migrated_url, \
            outbox_store(kind, tmp_path / "b") as file_url:
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        migrated(migrated_url)
        _run_sql_file(file_url, kind)
        by_migration, by_file = _shape(migrated_url), _shape(file_url)
        assert by_migration == by_file
        own = kind == "postgresql"  # PostgreSQL's own columns (NOT NULL) and indexes
        for table in metadata.sorted_tables:
            found = by_migration[table.name]
            extra = POSTGRESQL_COLUMNS.get(table.name, ()) if own else ()
            assert [c[0] for c in found["columns"]] == [c.name for c in table.columns] + [
                *extra]
            assert [c[2] for c in found["columns"]] == [c.nullable for c in table.columns] + [
                False for _ in extra]
            indexes = {i.name: tuple(c.name for c in i.columns) for i in table.indexes}
            if own:
                indexes.update({n: c for n, c in POSTGRESQL_INDEXES.items() if n in indexes})
            assert sorted((i[0], i[1]) for i in found["indexes"]) == sorted(indexes.items())
        # A database made from the file is up to date for the relay, which changes nothing.
        store = OutboxStore(file_url)
        assert store.revision() == HEAD
        store.check_schema()
        store.migrate()
        store.close()
        assert _shape(file_url) == by_file


@pytest.mark.parametrize("kind", STORES)
def test_the_outbox_migration_leaves_the_applications_own_alembic_history_alone(
    tmp_path: Path, kind: str,
) -> None:
    with outbox_store(kind, tmp_path) as url:
        engine = _engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) "
                                 "NOT NULL PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO alembic_version VALUES ('app_0042')"))
            conn.execute(sa.text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
        migrated(url)
        migrated(url)  # twice: the second finds nothing to do
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).all() == [
                ("app_0042",)]
            assert conn.execute(sa.text(
                "SELECT version_num FROM rabbit_retry_outbox_version")).all() == [(HEAD,)]
        engine.dispose()


def _at_revision_0001(url: str) -> None:
    """The outbox's tables as revision 0001 made them (what a relay before 0002 left)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location",
                           str(resources.files("rabbit_retry.outbox") / "migrations"))
    engine = _engine(url)
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0001")
    finally:
        engine.dispose()


_TOPOLOGY = "version: 1\nqueues:\n  shop.orders: {queue_type: classic}\n"


@pytest.mark.parametrize("kind", STORES)
def test_an_outbox_of_revision_0001_upgrades_and_its_waiting_events_go_out_first_in_id_order(
    tmp_path: Path, kind: str,
) -> None:
    """Events added before the upgrade keep their order and come before any added after it
    (PostgreSQL: their ``xid`` is 0); the tables end as a new database's. On SQLite the upgrade
    changes nothing, and ``--no-migrate`` takes a 0001 database as it is."""
    (tmp_path / "topology.yml").write_text(_TOPOLOGY)
    outbox = Outbox(tmp_path / "topology.yml")
    with outbox_store(kind, tmp_path / "a") as url, outbox_store(kind, tmp_path / "b") as new:
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        _at_revision_0001(url)
        before = _shape(url)
        engine = _engine(url)
        try:
            with engine.begin() as conn:
                for i in range(3):
                    outbox.add(conn, queue="shop.orders", body=b"", message_id=f"old-{i}",
                               key="k")
            if kind == "sqlite":  # 0002 changed nothing here: a 0001 file is up to date
                store = OutboxStore(url)
                store.check_schema()
                store.close()
            migrated(url)
            migrated(new)
            if kind == "sqlite":
                assert _shape(url) == before
            assert _shape(url) == _shape(new)
            with engine.begin() as conn:
                outbox.add(conn, queue="shop.orders", body=b"", message_id="new", key="k")
            claimable(url)
            store = OutboxStore(url)
            try:
                assert store.revision() == HEAD
                store.check_schema()
                claim = store.claim(10)
                store.release(claim)
            finally:
                store.close()
            assert [r.message_id for r in claim.rows] == ["old-0", "old-1", "old-2", "new"]
            if kind == "postgresql":
                with engine.connect() as conn:
                    xids = conn.execute(sa.text(
                        "SELECT message_id, xid::text::bigint FROM rabbit_retry_outbox "
                        "ORDER BY id")).all()
                assert [(m, x) for m, x in xids[:3]] == [(f"old-{i}", 0) for i in range(3)]
                assert xids[3][0] == "new" and xids[3][1] > 0
        finally:
            engine.dispose()


def test_a_postgresql_outbox_of_revision_0001_upgrades_with_the_sql_script_too(
    tmp_path: Path,
) -> None:
    """Teams that manage their own schema: a 0001 outbox, then
    ``sql/postgresql-upgrade-0002.sql``, has the tables a relay's migrations give (and a relay
    with ``--no-migrate`` takes them as they are)."""
    with outbox_store("postgresql", tmp_path) as url, \
            outbox_store("postgresql", tmp_path) as new:
        _at_revision_0001(url)
        _run_sql_file(url, "postgresql", "postgresql-upgrade-0002")
        migrated(new)
        assert _shape(url) == _shape(new)
        store = OutboxStore(url)
        store.check_schema()
        store.close()
