"""The outbox's first tables: events, their history, the SQLite relay lease.

Written out in full (not taken from ``schema``): a migration stays what it was when it shipped,
whatever the schema becomes later.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from rabbit_retry.outbox.schema import Id, Timestamp

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_NOW = {
    "postgresql": "clock_timestamp()",
    "sqlite": "(strftime('%Y-%m-%d %H:%M:%f', 'now'))",
}


def _partial_index(name: str, columns: list[str], condition: str) -> None:
    where = sa.text(condition)
    op.create_index(name, "rabbit_retry_outbox", columns, postgresql_where=where,
                    sqlite_where=where)


def upgrade() -> None:
    now = sa.text(_NOW[op.get_bind().dialect.name])
    op.create_table(
        "rabbit_retry_outbox",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("created_at", Timestamp, nullable=False, server_default=now),
        sa.Column("exchange", sa.Text, nullable=False),
        sa.Column("routing_key", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column("order_key", sa.Text),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("headers", sa.LargeBinary),
        sa.Column("properties", sa.Text),
        sa.Column("trace", sa.Text),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("due_at", Timestamp),
        sa.Column("last_error", sa.Text),
        sa.Column("changed_at", Timestamp),
        sa.Column("published_at", Timestamp),
        sqlite_autoincrement=True,
    )
    _partial_index("ix_rabbit_retry_outbox_waiting", ["id"],
                   "status IN ('pending', 'failed')")
    _partial_index("ix_rabbit_retry_outbox_key", ["order_key", "id"],
                   "status IN ('pending', 'failed', 'dead') AND order_key IS NOT NULL")
    _partial_index("ix_rabbit_retry_outbox_held", ["order_key", "id"],
                   "status IN ('failed', 'dead') AND order_key IS NOT NULL")
    _partial_index("ix_rabbit_retry_outbox_published", ["published_at"],
                   "status IN ('published')")
    _partial_index("ix_rabbit_retry_outbox_dead", ["status", "changed_at"],
                   "status IN ('dead', 'discarded')")
    op.create_index("ix_rabbit_retry_outbox_message_id", "rabbit_retry_outbox", ["message_id"])
    op.create_table(
        "rabbit_retry_outbox_history",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("event_id", Id, nullable=False),
        sa.Column("at", Timestamp, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer),
        sa.Column("detail", sa.Text),
        sa.Column("actor", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_rabbit_retry_outbox_history_event", "rabbit_retry_outbox_history",
                    ["event_id", "id"])
    op.create_table(
        "rabbit_retry_outbox_lease",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("until", Timestamp, nullable=False),
    )


def downgrade() -> None:
    for table in ("rabbit_retry_outbox_lease", "rabbit_retry_outbox_history",
                  "rabbit_retry_outbox"):
        op.drop_table(table)
