"""PostgreSQL: each event's transaction id (``xid``), and the relay's ordered scans by it.

A key's events were published in ``id`` order, among the rows committed when the relay looked:
a transaction that added a key's event and committed before an earlier one still open had its
event published first, and the earlier one's after it. The relay now takes a row only once every
transaction that took its id before the row's has ended, in ``(xid, id)`` order (see
``outbox.store.OutboxStore.claim``), so it needs the id of the transaction that added each row.

- ``xid xid8 NOT NULL DEFAULT pg_current_xact_id()``. The column is added with the constant 0
  first, which PostgreSQL (11 and later) records in the catalog without rewriting the table:
  the rows already there read 0 and come first, in ``id`` order. That is their true place:
  the ``ALTER TABLE`` waits for every transaction that added a row to end, so each of them
  committed (or rolled back) before any row added with a transaction id. Then the default
  becomes ``pg_current_xact_id()`` for the rows added from then on.
- ``ix_rabbit_retry_outbox_waiting`` and ``ix_rabbit_retry_outbox_key`` are made again on
  ``(xid, id)`` and ``(order_key, xid, id)``: the claim's scan and a key's first rows, in the new
  order. They are partial (waiting and unpublished rows), but building one reads the whole
  table while the application's inserts into it wait: on a large outbox (``--keep`` keeps
  the published rows), migrate at a quiet moment.

SQLite has one writer at a time, so its ``id`` order is already commit order: nothing changes
there but the revision.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_WAITING = "status IN ('pending', 'failed')"
_UNPUBLISHED = "status IN ('pending', 'failed', 'dead') AND order_key IS NOT NULL"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE rabbit_retry_outbox ADD COLUMN xid xid8 NOT NULL DEFAULT '0'")
    op.execute("ALTER TABLE rabbit_retry_outbox ALTER COLUMN xid "
               "SET DEFAULT pg_current_xact_id()")
    op.execute("DROP INDEX ix_rabbit_retry_outbox_waiting")
    op.execute(f"CREATE INDEX ix_rabbit_retry_outbox_waiting ON rabbit_retry_outbox (xid, id) "
               f"WHERE {_WAITING}")
    op.execute("DROP INDEX ix_rabbit_retry_outbox_key")
    op.execute("CREATE INDEX ix_rabbit_retry_outbox_key ON rabbit_retry_outbox "
               f"(order_key, xid, id) WHERE {_UNPUBLISHED}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX ix_rabbit_retry_outbox_waiting")
    op.execute(f"CREATE INDEX ix_rabbit_retry_outbox_waiting ON rabbit_retry_outbox (id) "
               f"WHERE {_WAITING}")
    op.execute("DROP INDEX ix_rabbit_retry_outbox_key")
    op.execute("CREATE INDEX ix_rabbit_retry_outbox_key ON rabbit_retry_outbox (order_key, id) "
               f"WHERE {_UNPUBLISHED}")
    op.execute("ALTER TABLE rabbit_retry_outbox DROP COLUMN xid")
