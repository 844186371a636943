"""The desk's first tables: messages, groups, audit, replays, totals.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from rabbit_retry.desk.schema import Id, UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "messages",
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
    )
    for name, columns in (
        ("ix_messages_status_group", ["status", "group_id", "parked_at"]),
        ("ix_messages_status_parked", ["status", "parked_at"]),
        ("ix_messages_queue_status_parked", ["queue", "status", "parked_at"]),
        ("ix_messages_status_queue_reason", ["status", "queue", "reason", "parked_at"]),
        ("ix_messages_status_changed", ["status", "changed_at"]),
        ("ix_messages_message_id", ["message_id"]),
        ("ix_messages_correlation_id", ["correlation_id"]),
        ("ix_messages_replay_id", ["replay_id"]),
    ):
        op.create_index(name, "messages", columns)
    op.create_table(
        "groups",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("exception_type", sa.Text),
        sa.Column("pattern", sa.Text, nullable=False),
        sa.Column("sample", sa.Text),
    )
    op.create_table(
        "audit",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("at", UtcDateTime, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("selection", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("replay_id", sa.String(32), unique=True),
        sa.Column("to_queue", sa.Text),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("done_at", UtcDateTime),
        sa.Column("outcome", sa.Text),
        sa.Column("done_count", sa.Integer),
    )
    op.create_index("ix_audit_at", "audit", ["at"])
    op.create_table(
        "replays",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("to_queue", sa.Text),
        sa.Column("rate", sa.Float),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("lease_until", UtcDateTime, nullable=False),
    )
    op.create_table(
        "totals",
        sa.Column("queue", sa.Text, primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("count", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("totals", "replays", "audit", "groups", "messages"):
        op.drop_table(table)
