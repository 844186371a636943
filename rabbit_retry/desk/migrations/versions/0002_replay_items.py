"""replay_items: the rows a replay took, claimed page by page as it publishes.

A replay used to set every row of its selection to ``replaying`` in the transaction that
started it (10,000 full-row rewrites before its first publish); now that transaction records
only which rows the replay took, and each page is claimed while the previous one is published.
Replays in progress at the upgrade keep their rows.

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


def downgrade() -> None:
    op.drop_table("replay_items")
