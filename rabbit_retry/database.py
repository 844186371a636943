"""Store URLs and SQLAlchemy engines for the stores rabbit-retry keeps in a database: the outbox
relay's (the application's own database) and the failure desk's.

A store is ``sqlite:///PATH`` or ``postgresql://user:pass@host/db`` (driven by psycopg 3). The
engine's SQLite connections run in WAL mode (readers never wait for the writer) with
``synchronous=FULL`` (a commit survives a power loss: the broker hears an ack, or a row is
marked published, only after it).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from rabbit_retry.errors import InputError
from rabbit_retry.settings import shown


def engine_url(url: str, option: str = "--store") -> sa.URL:
    """The SQLAlchemy URL of a store URL; ``InputError`` naming ``option`` for any other."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise InputError(f"{option}: not a store URL: {shown(url)!r} (use sqlite:///PATH or "
                         "postgresql://user:pass@host/db)") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise InputError(f"{option}: an SQLite store needs a file: sqlite:///PATH")
        return parsed.set(drivername="sqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    raise InputError(f"{option}: unsupported database {backend!r} in {shown(url)!r} "
                     "(use sqlite:///PATH or postgresql://...)")


def create_engine(url: str, *, pool_size: int = 5, option: str = "--store") -> Engine:
    """An engine for the store ``url``."""
    target = engine_url(url, option)
    if target.get_backend_name() == "sqlite":
        engine = sa.create_engine(target, connect_args={"timeout": 30,
                                                        "check_same_thread": False})
        sa.event.listen(engine, "connect", sqlite_pragmas)
        return engine
    # psycopg's executemany pipelines the rows; SQLAlchemy's "insertmanyvalues" would build one
    # statement with thousands of parameters per batch instead.
    return sa.create_engine(target, pool_size=pool_size, pool_pre_ping=True,
                            use_insertmanyvalues=False)


def sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def run_migrations(engine: Engine, package: str, lock: int) -> None:
    """Bring the tables of ``package`` (its ``migrations``: Alembic's env and versions) to the
    newest migration, on ``engine``. On PostgreSQL the transaction first takes the advisory lock
    ``lock``, so that several processes starting at once migrate one after the other."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files(package) / "migrations"))
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
