"""The outbox's schema three ways, one schema: what the relay's Alembic migrations make, what
``rabbit_retry/outbox/sql/*.sql`` makes for teams that manage their own, and the tables the code
queries (``outbox.schema``), on SQLite and PostgreSQL. A relay finds a database made from the
SQL file up to date (and ``--no-migrate`` accepts it), and its migration lives beside the
application's own Alembic history without touching it."""

from __future__ import annotations

import sqlite3
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.outbox import migrated, outbox_store

from rabbit_retry.outbox.schema import metadata
from rabbit_retry.outbox.store import HEAD, OutboxStore

STORES = ["sqlite", "postgresql"]


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


def _run_sql_file(url: str, kind: str) -> None:
    script = (resources.files("rabbit_retry.outbox") / "sql" / f"{kind}.sql").read_text()
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
            columns = [(c["name"], str(c["type"]), c["nullable"],
                        str(c.get("default") or "").replace("'::character varying", "'"))
                       for c in inspector.get_columns(table)]
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
        for table in metadata.sorted_tables:
            found = by_migration[table.name]
            assert [c[0] for c in found["columns"]] == [c.name for c in table.columns]
            assert [c[2] for c in found["columns"]] == [c.nullable for c in table.columns]
            assert sorted((i[0], i[1]) for i in found["indexes"]) == sorted(
                (i.name, tuple(c.name for c in i.columns)) for i in table.indexes)
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
