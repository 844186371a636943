"""A desk a team can share: sessions, notes, grouping rules, message history, replay progress.

- ``messages`` gain ``source`` (``parking``), ``replay_of`` (the desk replay a copy came back
  from), ``grouping`` (the generation of grouping rules its group was computed under: 0 for
  every row stored so far, so the desk regroups them under the new built-in rules once) and
  ``release_pending`` (a discarded holder of an ordered key whose release is not sent yet).
- ``audit`` gains a replay's ``refused`` and ``resent`` counts, who cancelled it, and ``detail``
  (an edit's diff, a rule); a replay in progress is ``running`` (it was ``pending``).
- ``replays`` gain ``cancel_by`` and an edit's body and headers.
- New: ``message_events``, ``group_notes``, ``grouping_rules``, ``sessions``, ``desk_meta``
  (with the key that signs session cookies, made here once for every desk on the store).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

from rabbit_retry.desk.schema import Id, UtcDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

GROUPING = "1"  # the built-in rules of this release; rows stored before are regrouped


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("source", sa.String(16), nullable=False,
                                   server_default="parking"))
        batch.add_column(sa.Column("replay_of", sa.String(32)))
        batch.add_column(sa.Column("grouping", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("release_pending", sa.Boolean, nullable=False,
                                   server_default=sa.false()))
    op.create_index("ix_messages_replay_of", "messages", ["replay_of"])
    op.create_index("ix_messages_grouping", "messages", ["grouping"])
    op.create_index("ix_messages_release_pending", "messages", ["release_pending"])
    with op.batch_alter_table("audit") as batch:
        batch.add_column(sa.Column("refused", sa.Integer))
        batch.add_column(sa.Column("resent", sa.Integer))
        batch.add_column(sa.Column("cancelled_by", sa.Text))
        batch.add_column(sa.Column("detail", sa.JSON))
    op.execute("UPDATE audit SET state = 'running' WHERE state = 'pending'")
    with op.batch_alter_table("replays") as batch:
        batch.add_column(sa.Column("cancel_by", sa.Text))
        batch.add_column(sa.Column("edit_body", sa.LargeBinary))
        batch.add_column(sa.Column("edit_headers", sa.LargeBinary))
    op.create_table(
        "message_events",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("message_id", Id, nullable=False),
        sa.Column("audit_id", Id, nullable=False),
    )
    op.create_index("ix_message_events_message", "message_events", ["message_id"])
    op.create_table(
        "group_notes",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("group_id", sa.String(16), nullable=False),
        sa.Column("at", UtcDateTime, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
    )
    op.create_index("ix_group_notes_group", "group_notes", ["group_id", "at"])
    op.create_table(
        "grouping_rules",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("queue", sa.Text),
        sa.Column("pattern", sa.Text, nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("at", UtcDateTime, nullable=False),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("identity", sa.Text, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("how", sa.String(16), nullable=False),
        sa.Column("credential", sa.String(64), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("expires_at", UtcDateTime, nullable=False),
    )
    op.create_index("ix_sessions_expires", "sessions", ["expires_at"])
    meta = op.create_table(
        "desk_meta",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.bulk_insert(meta, [{"name": "session_key", "value": secrets.token_hex(32)},
                          {"name": "grouping", "value": GROUPING}])


def downgrade() -> None:
    for table in ("desk_meta", "sessions", "grouping_rules", "group_notes", "message_events"):
        op.drop_table(table)
    with op.batch_alter_table("replays") as batch:
        for column in ("edit_headers", "edit_body", "cancel_by"):
            batch.drop_column(column)
    op.execute("UPDATE audit SET state = 'pending' WHERE state = 'running'")
    with op.batch_alter_table("audit") as batch:
        for column in ("detail", "cancelled_by", "resent", "refused"):
            batch.drop_column(column)
    op.drop_index("ix_messages_release_pending", "messages")
    op.drop_index("ix_messages_grouping", "messages")
    op.drop_index("ix_messages_replay_of", "messages")
    with op.batch_alter_table("messages") as batch:
        for column in ("release_pending", "grouping", "replay_of", "source"):
            batch.drop_column(column)
