"""replay_items: the rows a replay holds, claimed page by page as it publishes.

A replay used to write every row of its selection ``replaying`` in the transaction that started
it (10,000 full-row writes before its first publish) and ``replayed`` again once confirmed. Now
that transaction records only which rows the replay took; each page is written ``replayed``
(its one write) while the page before is published, and a row's ``replay_items`` entry, deleted
once the broker confirmed its copy, is what makes it ``replaying``. Replays in progress at the
upgrade keep their rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from rabbit_retry.desk.schema import Id

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replay_items",
        sa.Column("message_id", Id, primary_key=True),
        sa.Column("replay_id", sa.String(32), nullable=False),
    )
    op.create_index("ix_replay_items_replay", "replay_items", ["replay_id", "message_id"])
    op.execute("INSERT INTO replay_items (message_id, replay_id) SELECT id, replay_id "
               "FROM messages WHERE status = 'replaying' AND replay_id IS NOT NULL")
    op.execute("UPDATE messages SET status = 'replayed' WHERE status = 'replaying'")


def downgrade() -> None:
    op.execute("UPDATE messages SET status = 'replaying' WHERE id IN "
               "(SELECT message_id FROM replay_items) AND status = 'replayed'")
    op.drop_table("replay_items")
