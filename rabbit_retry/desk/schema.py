"""The desk's tables (SQLAlchemy Core), as the newest migration leaves them.

The migrations in ``desk/migrations/versions`` create and change the real tables; this module is
what the code queries, and tests/unit/test_desk_store.py checks that the two agree.

- ``messages``: one row per parked copy (``records.Parked``); ``status`` is ``parked``,
  ``replayed`` (written when a replay claims the row) or ``discarded``. The desk shows a
  ``replayed`` row as ``replaying`` while its replay still holds it (``replay_items``: the
  broker has not confirmed its copy yet). ``source`` says where it came from (``parking``; the
  outbox's dead events will be another), ``replay_of`` which desk replay it came back from (the
  ``replay-id`` its copy carried when it parked again), ``grouping`` under which generation of
  the grouping rules its ``group_id`` was computed.
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
  its copy. Rows are written ``replayed`` a few at a time, just before their copies are
  published: a row ``replayed`` and still held is one whose copy may be on its way.
- ``message_events``: which audit entries (discard, restore) touched which row, for a message's
  history (a replay is the row's ``replay_id``).
- ``group_notes``: what operators wrote about a group.
- ``grouping_rules``: operators' own grouping rules (``groups.Rule``).
- ``sessions``: the page's logins (the hash of each session id, whose, until when).
- ``desk_meta``: the key that signs session cookies, the grouping generation.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

# The statuses the desk shows and filters by (``replaying`` is derived, see above).
STATUSES = ("parked", "replaying", "replayed", "discarded")
# Where a stored message came from: a parking queue (the outbox's dead events will be another).
SOURCES = ("parking",)
# How a replay's audit entry ends (``running`` until then).
REPLAY_STATES = ("running", "done", "failed", "cancelled")


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
    sa.Column("source", sa.String(16), nullable=False, server_default="parking"),
    sa.Column("replay_of", sa.String(32)),
    sa.Column("grouping", sa.Integer, nullable=False, server_default="0"),
    # A discarded copy that held its ordered key: the key's release is still to be sent.
    sa.Column("release_pending", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Index("ix_messages_status_group", "status", "group_id", "parked_at"),
    sa.Index("ix_messages_status_parked", "status", "parked_at"),
    sa.Index("ix_messages_queue_status_parked", "queue", "status", "parked_at"),
    sa.Index("ix_messages_status_queue_reason", "status", "queue", "reason", "parked_at"),
    sa.Index("ix_messages_status_changed", "status", "changed_at"),
    sa.Index("ix_messages_message_id", "message_id"),
    sa.Index("ix_messages_correlation_id", "correlation_id"),
    sa.Index("ix_messages_replay_id", "replay_id"),
    sa.Index("ix_messages_replay_of", "replay_of"),
    sa.Index("ix_messages_grouping", "grouping"),
    sa.Index("ix_messages_release_pending", "release_pending"),
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
    # done, or a replay's state: running | done | failed | cancelled
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("done_at", UtcDateTime),
    sa.Column("outcome", sa.Text),
    sa.Column("done_count", sa.Integer),  # a replay's copies confirmed so far
    sa.Column("refused", sa.Integer),  # a replay's copies the broker returned or refused
    sa.Column("resent", sa.Integer),  # copies re-sent when a replay was resumed (maybe twice)
    sa.Column("cancelled_by", sa.Text),
    sa.Column("detail", sa.JSON),  # an edit's diff, a rule, a restore's reason
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
    sa.Column("cancel_by", sa.Text),  # who asked it to stop (any desk may be running it)
    # An edit and replay publishes this body and these headers instead of the row's.
    sa.Column("edit_body", sa.LargeBinary),
    sa.Column("edit_headers", sa.LargeBinary),
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

message_events = sa.Table(
    "message_events",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("message_id", Id, nullable=False),
    sa.Column("audit_id", Id, nullable=False),
    sa.Index("ix_message_events_message", "message_id"),
)

group_notes = sa.Table(
    "group_notes",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("group_id", sa.String(16), nullable=False),
    sa.Column("at", UtcDateTime, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Index("ix_group_notes_group", "group_id", "at"),
)

grouping_rules = sa.Table(
    "grouping_rules",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("queue", sa.Text),
    sa.Column("pattern", sa.Text, nullable=False),
    sa.Column("name", sa.String(32), nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("at", UtcDateTime, nullable=False),
)

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # sha256 of the session id
    sa.Column("identity", sa.Text, nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("how", sa.String(16), nullable=False),
    sa.Column("credential", sa.String(64), nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("expires_at", UtcDateTime, nullable=False),
    sa.Index("ix_sessions_expires", "expires_at"),
)

desk_meta = sa.Table(
    "desk_meta",
    metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)
