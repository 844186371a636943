"""The desk's tables (SQLAlchemy Core), as the newest migration leaves them.

The migrations in ``desk/migrations/versions`` create and change the real tables; this module is
what the code queries, and tests/unit/test_desk_store.py checks that the two agree.

- ``messages``: one row per parked copy (``records.Parked``); ``status`` is ``parked``,
  ``replayed`` (written when a replay claims the row) or ``discarded``. The desk shows a
  ``replayed`` row as ``replaying`` while its replay still holds it (``replay_items``: the
  broker has not confirmed its copy yet).
- ``groups``: what a group id stands for (queue, reason, exception type, normalised message) and
  a sample message; its counts come from ``messages``.
- ``audit``: who did what, when, to how many, with which selection and reason. Never deleted.
- ``totals``: messages ingested, replayed and discarded per queue since the store began (the
  desk's counters: they survive restarts, retention and several desks), kept in the same
  transaction as what they count.
- ``replays``: a replay in progress and the lease of the desk carrying it out, so that another
  desk (or the same one, restarted) finishes a replay whose desk died.
- ``replay_items``: the rows a replay in progress holds: every row it took when it started
  (a row belongs to one replay at a time; no other action takes it) until the broker confirmed
  its copy. Rows are written ``replayed`` a page at a time as the replay publishes them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

# The statuses the desk shows and filters by (``replaying`` is derived, see above).
STATUSES = ("parked", "replaying", "replayed", "discarded")


class UtcDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every database: stored without zone (as UTC), read back aware."""

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"not a datetime: {value!r}")
        moment: datetime = value
        if moment.tzinfo is not None:
            moment = moment.astimezone(UTC).replace(tzinfo=None)
        return moment

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# BIGINT on PostgreSQL; INTEGER on SQLite, where only an INTEGER PRIMARY KEY is the rowid.
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData()

messages = sa.Table(
    "messages",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("digest", sa.String(64), nullable=False, unique=True),
    sa.Column("queue", sa.Text, nullable=False),
    sa.Column("message_id", sa.Text),
    sa.Column("correlation_id", sa.Text),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("exception_type", sa.Text),
    sa.Column("exception_message", sa.Text),
    sa.Column("attempts", sa.Integer),
    sa.Column("parked_at", UtcDateTime, nullable=False),
    sa.Column("ingested_at", UtcDateTime, nullable=False),
    sa.Column("changed_at", UtcDateTime),
    sa.Column("group_id", sa.String(16), nullable=False),
    sa.Column("headers", sa.JSON, nullable=False),
    sa.Column("headers_raw", sa.LargeBinary, nullable=False),
    sa.Column("properties", sa.JSON, nullable=False),
    sa.Column("body_text", sa.Text),
    sa.Column("body", sa.LargeBinary),
    sa.Column("replay_id", sa.String(32)),
    sa.Column("replayed_to", sa.Text),
    sa.Column("discard_reason", sa.Text),
    sa.Index("ix_messages_status_group", "status", "group_id", "parked_at"),
    sa.Index("ix_messages_status_parked", "status", "parked_at"),
    sa.Index("ix_messages_queue_status_parked", "queue", "status", "parked_at"),
    sa.Index("ix_messages_status_queue_reason", "status", "queue", "reason", "parked_at"),
    sa.Index("ix_messages_status_changed", "status", "changed_at"),
    sa.Index("ix_messages_message_id", "message_id"),
    sa.Index("ix_messages_correlation_id", "correlation_id"),
    sa.Index("ix_messages_replay_id", "replay_id"),
)

groups = sa.Table(
    "groups",
    metadata,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("queue", sa.Text, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("exception_type", sa.Text),
    sa.Column("pattern", sa.Text, nullable=False),
    sa.Column("sample", sa.Text),
)

audit = sa.Table(
    "audit",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("at", UtcDateTime, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("selection", sa.JSON, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("replay_id", sa.String(32), unique=True),
    sa.Column("to_queue", sa.Text),
    sa.Column("state", sa.String(16), nullable=False),  # pending | done | failed
    sa.Column("done_at", UtcDateTime),
    sa.Column("outcome", sa.Text),
    sa.Column("done_count", sa.Integer),
    sa.Index("ix_audit_at", "at"),
)

replays = sa.Table(
    "replays",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("to_queue", sa.Text),
    sa.Column("rate", sa.Float),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("lease_until", UtcDateTime, nullable=False),
)

replay_items = sa.Table(
    "replay_items",
    metadata,
    sa.Column("message_id", Id, primary_key=True),
    sa.Column("replay_id", sa.String(32), nullable=False),
    sa.Index("ix_replay_items_replay", "replay_id", "message_id"),
)

totals = sa.Table(
    "totals",
    metadata,
    sa.Column("queue", sa.Text, primary_key=True),
    sa.Column("kind", sa.String(16), primary_key=True),  # ingested | replayed | discarded
    sa.Column("count", sa.BigInteger, nullable=False),
)
