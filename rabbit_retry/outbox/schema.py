"""The outbox's tables (SQLAlchemy Core), as the newest migration leaves them.

They live in the application's own database, beside its tables, so every name starts with
``rabbit_retry_outbox`` and Alembic keeps its revision in a table of ours
(``rabbit_retry_outbox_version``), never in the application's ``alembic_version``. The migrations
in ``outbox/migrations/versions`` create and change the real tables, ``outbox/sql/*.sql`` is the
same schema for teams that manage their own; tests/unit/test_outbox_schema.py checks that the
three agree.

- ``rabbit_retry_outbox``: one row per event ``Outbox.add`` wrote. ``status`` is ``pending``
  (written, not yet published), ``published`` (the broker confirmed it), ``failed`` (the broker
  returned or refused it; tried again at ``due_at``), ``dead`` (failed ``max_attempts`` times;
  an operator retries or discards it) or ``discarded``. ``order_key`` is the event's order key:
  rows of one key are published in ``id`` order on SQLite, in ``(xid, id)`` order on PostgreSQL.
  On PostgreSQL only, ``xid`` is the id of the transaction that added the row (``xid8``, filled
  in by ``pg_current_xact_id()``; revision 0002): see ``POSTGRESQL_COLUMNS`` below.
- ``rabbit_retry_outbox_history``: what happened to a row besides being added and published
  (those two are the row's ``created_at`` and ``published_at``): each failure with the broker's
  reason, dead, an operator's retry or discard with who and why. Written in the transaction
  that changes the row.
- ``rabbit_retry_outbox_lease``: on SQLite, the one relay that may publish (several relays on
  one SQLite file take turns: the others wait until its lease runs out).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.selectable import NamedFromClause
from sqlalchemy.types import TypeDecorator

from rabbit_retry.outbox.names import (
    HISTORY_TABLE,
    LEASE_TABLE,
    PENDING,
    TABLE,
)


class Timestamp(TypeDecorator[datetime]):
    """An aware UTC datetime: ``timestamp with time zone`` on PostgreSQL, UTC text on SQLite."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise TypeError(f"not an aware datetime: {value!r}")
        moment = value.astimezone(UTC)
        # SQLite keeps the text SQLAlchemy writes, which has no zone: UTC, like the default.
        return moment.replace(tzinfo=None) if dialect.name == "sqlite" else moment

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# BIGINT on PostgreSQL; INTEGER on SQLite, where only an INTEGER PRIMARY KEY is the rowid.
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

def _partial(condition: str) -> dict[str, Any]:
    """A partial index's ``WHERE``, on both databases."""
    return {"postgresql_where": sa.text(condition), "sqlite_where": sa.text(condition)}


metadata = sa.MetaData()

outbox = sa.Table(
    TABLE,
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    # When the row was added: the database's clock at the insert (a server default), so ``add``
    # sends no time of its own.
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("exchange", sa.Text, nullable=False),
    sa.Column("routing_key", sa.Text, nullable=False),
    sa.Column("message_id", sa.Text, nullable=False),
    sa.Column("order_key", sa.Text),
    sa.Column("body", sa.LargeBinary, nullable=False),
    sa.Column("headers", sa.LargeBinary),  # the AMQP field table, exactly as it goes out
    sa.Column("properties", sa.Text),  # JSON: the other message properties that were set
    sa.Column("trace", sa.Text),  # JSON: the trace context (traceparent...) at add
    sa.Column("status", sa.String(16), nullable=False, server_default=PENDING),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("due_at", Timestamp),  # a failed row's next try
    sa.Column("last_error", sa.Text),
    sa.Column("changed_at", Timestamp),  # the last change of status after pending
    sa.Column("published_at", Timestamp),
    # The relay's scan: waiting rows in id order (PostgreSQL: (xid, id), POSTGRESQL_INDEXES).
    sa.Index("ix_rabbit_retry_outbox_waiting", "id",
             **_partial("status IN ('pending', 'failed')")),
    # A key's first unpublished rows, in order (a claim checks it has them; PostgreSQL:
    # (order_key, xid, id)).
    sa.Index("ix_rabbit_retry_outbox_key", "order_key", "id",
             **_partial("status IN ('pending', 'failed', 'dead') AND order_key IS NOT NULL")),
    # "Does a failed or dead row hold this key?": one probe per keyed row, into the few rows
    # that failed (the index above would read every earlier pending row of the key).
    sa.Index("ix_rabbit_retry_outbox_held", "order_key", "id",
             **_partial("status IN ('failed', 'dead') AND order_key IS NOT NULL")),
    # Retention of published rows.
    sa.Index("ix_rabbit_retry_outbox_published", "published_at",
             **_partial("status IN ('published')")),
    # The desk's list of dead (and discarded) events.
    sa.Index("ix_rabbit_retry_outbox_dead", "status", "changed_at",
             **_partial("status IN ('dead', 'discarded')")),
    sa.Index("ix_rabbit_retry_outbox_message_id", "message_id"),
    # Ids are never used again on SQLite either (it would reuse the highest one once deleted).
    sqlite_autoincrement=True,
)

history = sa.Table(
    HISTORY_TABLE,
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("event_id", Id, nullable=False),
    sa.Column("at", Timestamp, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("attempt", sa.Integer),
    sa.Column("detail", sa.Text),  # the broker's reason, or the operator's
    sa.Column("actor", sa.Text),  # the relay, or the operator
    sa.Index("ix_rabbit_retry_outbox_history_event", "event_id", "id"),
    sqlite_autoincrement=True,
)

# PostgreSQL only (revision 0002). ``xid``: the id of the transaction that added the row,
# ``xid8 NOT NULL DEFAULT pg_current_xact_id()`` (the top-level transaction's, 64 bits: it never
# wraps around), after the table's other columns; rows added before revision 0002 have 0. The
# relay publishes a row only once every transaction that took its id before the row's has ended
# (relays' claims aside: ``store.HORIZON``), in ``(xid, id)`` order, so no row can
# appear later ahead of one already published (``store.OutboxStore.claim``). SQLite has one
# writer at a time, so ``id`` order is already commit order there: it has no such column. The
# column is not in ``outbox`` above (``select(outbox)`` reads both databases alike); queries
# name it with ``xid_of``.
POSTGRESQL_COLUMNS: dict[str, tuple[str, ...]] = {TABLE: ("xid",)}
# Indexes whose columns differ on PostgreSQL: the two ordered scans, by ``(xid, id)``.
POSTGRESQL_INDEXES: dict[str, tuple[str, ...]] = {
    "ix_rabbit_retry_outbox_waiting": ("xid", "id"),
    "ix_rabbit_retry_outbox_key": ("order_key", "xid", "id"),
}


def xid_of(table: NamedFromClause) -> sa.ColumnElement[Any]:
    """PostgreSQL: the ``xid`` column of ``table`` (``outbox`` or an alias of it)."""
    return sa.literal_column(f"{table.name}.xid")


lease = sa.Table(
    LEASE_TABLE,
    metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("until", Timestamp, nullable=False),
)
