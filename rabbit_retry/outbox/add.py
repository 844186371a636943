"""``Outbox``: adding an event to the application's own transaction.

The event is one ``INSERT`` on the connection (or session) the application already holds, so it
commits or rolls back with the application's own writes: a rolled-back transaction leaves no
event, a committed one leaves an event the relay publishes. Nothing here talks to the broker.

Connections taken: SQLAlchemy's ``Connection`` and ``Session`` (``add``) and ``AsyncConnection``
and ``AsyncSession`` (``await add_async``), psycopg 3's ``Connection`` (``add``) and
``AsyncConnection`` (``await add_async``), and the standard library's ``sqlite3.Connection``.
None of these libraries is imported unless the application passes one of its connections.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack

from rabbit_retry.outbox.destinations import Destinations
from rabbit_retry.outbox.event import Event, make_event
from rabbit_retry.outbox.names import ADDED, TABLE
from rabbit_retry.topology.resolved import Topology

Kind = Literal["sqlalchemy", "sqlalchemy-async", "psycopg", "psycopg-async", "sqlite3"]

_COLUMNS = ", ".join(ADDED)
# The same statement in each driver's parameter style.
SQL_NAMED = f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES ({', '.join(f':{c}' for c in ADDED)})"
SQL_PYFORMAT = f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES ({', '.join(f'%({c})s' for c in ADDED)})"

_TAKEN = ("a SQLAlchemy Connection or Session, a psycopg Connection or a sqlite3 Connection "
          "(AsyncConnection, AsyncSession: await add_async)")


class MessageProperties(TypedDict, total=False):
    """The AMQP properties an event may set besides ``message_id`` and ``headers``."""

    content_type: str
    content_encoding: str
    correlation_id: str
    reply_to: str
    expiration: int | str  # milliseconds
    priority: int
    timestamp: Any  # a datetime, or seconds since the epoch
    type: str
    app_id: str
    delivery_mode: int  # 2 (persistent) unless given


class Outbox:
    """Events for the destinations of one topology file, added in the application's own
    transactions; ``rabbit-retry relay`` publishes them."""

    def __init__(self, topology: str | os.PathLike[str] | Topology) -> None:
        if not isinstance(topology, Topology):
            from rabbit_retry.topology.load import load_topology

            topology = load_topology(Path(topology))
        self.topology = topology
        self.destinations = Destinations.of(topology)

    def event(self, *, exchange: str | None = None, routing_key: str | None = None,
              queue: str | None = None, body: bytes | bytearray | memoryview | str,
              message_id: str | None = None, key: str | None = None,
              headers: Mapping[str, Any] | None = None,
              **properties: Unpack[MessageProperties]) -> Event:
        """The event ``add`` would write, checked against the topology and AMQP's limits:
        ``UnknownDestination`` (a ``ValueError``) for a destination the file does not declare,
        ``ValueError`` or ``TypeError`` for a bad argument."""
        target, routing = self.destinations.resolve(exchange, routing_key, queue)
        return make_event(target, routing, body=body, message_id=message_id, key=key,
                          headers=headers, properties=properties)

    def add(self, conn: Any, *, exchange: str | None = None, routing_key: str | None = None,
            queue: str | None = None, body: bytes | bytearray | memoryview | str,
            message_id: str | None = None, key: str | None = None,
            headers: Mapping[str, Any] | None = None,
            **properties: Unpack[MessageProperties]) -> str:
        """Write an event in ``conn``'s transaction; returns its message id (a new one when
        none was given). Published once the transaction commits; never if it rolls back.

        ``exchange`` and ``routing_key``, or ``queue`` (a queue of the topology, reached
        through the default exchange); ``key`` orders the events that share it."""
        event = self.event(exchange=exchange, routing_key=routing_key, queue=queue, body=body,
                           message_id=message_id, key=key, headers=headers, **properties)
        kind = connection_kind(conn)
        _refuse_autocommit(kind, conn)
        if kind == "sqlalchemy":
            conn.execute(_statement(), event.row())
        elif kind == "psycopg":
            conn.execute(SQL_PYFORMAT, event.row())
        elif kind == "sqlite3":
            conn.execute(SQL_NAMED, event.row())
        else:
            raise TypeError(f"add: {type(conn).__name__} is asynchronous: use "
                            "`await outbox.add_async(conn, ...)`")
        return event.message_id

    async def add_async(self, conn: Any, *, exchange: str | None = None,
                        routing_key: str | None = None, queue: str | None = None,
                        body: bytes | bytearray | memoryview | str,
                        message_id: str | None = None, key: str | None = None,
                        headers: Mapping[str, Any] | None = None,
                        **properties: Unpack[MessageProperties]) -> str:
        """``add`` on an asynchronous connection or session (SQLAlchemy's ``AsyncConnection``
        or ``AsyncSession``, psycopg's ``AsyncConnection``)."""
        event = self.event(exchange=exchange, routing_key=routing_key, queue=queue, body=body,
                           message_id=message_id, key=key, headers=headers, **properties)
        kind = connection_kind(conn)
        _refuse_autocommit(kind, conn)
        if kind == "sqlalchemy-async":
            await conn.execute(_statement(), event.row())
        elif kind == "psycopg-async":
            await conn.execute(SQL_PYFORMAT, event.row())
        else:
            raise TypeError(f"add_async: {type(conn).__name__} is synchronous: use "
                            "`outbox.add(conn, ...)`")
        return event.message_id


def _refuse_autocommit(kind: Kind, conn: Any) -> None:
    """A connection in autocommit mode outside a transaction would commit the event on its own,
    whatever became of the application's other writes: that is no outbox. (A SQLAlchemy
    ``Connection`` is looked at through its driver's connection: SQLite's or psycopg's; a
    ``Session`` through the connection of its transaction.)"""
    raw, what = conn, type(conn).__name__
    if kind == "sqlalchemy" and not hasattr(conn, "get_execution_options"):
        conn = conn.connection()  # a Session: the connection its transaction (begun now) uses
    if kind == "sqlalchemy" and hasattr(conn, "get_execution_options"):
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            raw = None
        else:
            raw = conn.connection.dbapi_connection
    if raw is None or _alone(raw):
        raise ValueError(f"add: the {what} is in autocommit mode outside a "
                         "transaction, so the event would commit on its own; add it inside the "
                         "transaction of the writes it belongs with; nothing was written")


def _alone(raw: Any) -> bool:
    """Whether a driver's connection autocommits each statement right now."""
    if isinstance(raw, sqlite3.Connection):
        autocommit = raw.isolation_level is None or getattr(raw, "autocommit", None) is True
        return autocommit and not raw.in_transaction
    if type(raw).__module__.startswith("psycopg") and hasattr(raw, "info"):
        return bool(raw.autocommit) and raw.info.transaction_status == 0  # IDLE
    return False


_STATEMENT: list[Any] = []


def _statement() -> Any:
    """The insert as a SQLAlchemy statement, made once: plain text (no ``RETURNING`` of the new
    id, which a Core insert would add on PostgreSQL), bytes typed for every driver."""
    if not _STATEMENT:
        import sqlalchemy as sa

        _STATEMENT.append(sa.text(SQL_NAMED).bindparams(
            sa.bindparam("body", type_=sa.LargeBinary),
            sa.bindparam("headers", type_=sa.LargeBinary)))
    return _STATEMENT[0]


_KINDS: dict[type[Any], Kind] = {}


def connection_kind(conn: Any) -> Kind:
    """Which kind of connection ``conn`` is; ``TypeError`` for anything ``add`` cannot use."""
    cls = type(conn)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind_of(conn)
    return kind


def _kind_of(conn: Any) -> Kind:
    if isinstance(conn, sqlite3.Connection):
        return "sqlite3"
    modules = {c.__module__.partition(".")[0] for c in type(conn).__mro__}
    if "sqlalchemy" in modules:
        from sqlalchemy.engine import Connection
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        from sqlalchemy.orm import Session

        if isinstance(conn, Connection | Session):
            return "sqlalchemy"
        if isinstance(conn, AsyncConnection | AsyncSession):
            return "sqlalchemy-async"
    if "psycopg" in modules:
        import psycopg

        if isinstance(conn, psycopg.AsyncConnection):
            return "psycopg-async"
        if isinstance(conn, psycopg.Connection):
            return "psycopg"
    raise TypeError(f"add: {type(conn).__name__} is not a connection add can use: {_TAKEN}")
