"""The outbox's names, without SQLAlchemy: its tables, its statuses, the columns ``add`` writes.

``add`` writes through whatever driver the application uses and must not load SQLAlchemy for
it; ``schema`` builds the tables from these names.
"""

from __future__ import annotations

TABLE = "rabbit_retry_outbox"
HISTORY_TABLE = "rabbit_retry_outbox_history"
LEASE_TABLE = "rabbit_retry_outbox_lease"
VERSION_TABLE = "rabbit_retry_outbox_version"  # Alembic's, of the outbox alone

PENDING, PUBLISHED, FAILED, DEAD, DISCARDED = "pending", "published", "failed", "dead", "discarded"
STATUSES = (PENDING, PUBLISHED, FAILED, DEAD, DISCARDED)
WAITING = (PENDING, FAILED)  # to be published (a failed row once its ``due_at`` has come)
UNPUBLISHED = (PENDING, FAILED, DEAD)  # rows that can hold their order key

# The columns ``add`` writes; the database fills in the rest.
ADDED = ("exchange", "routing_key", "message_id", "order_key", "body", "headers", "properties",
         "trace")
