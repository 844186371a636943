"""Alembic's entry point for the outbox's tables: migrations run on the connection the relay
hands over (``config.attributes["connection"]``), never from a URL in a file, and record their
revision in ``rabbit_retry_outbox_version``: the application's own Alembic (``alembic_version``)
never sees them."""

from __future__ import annotations

from alembic import context

from rabbit_retry.outbox.names import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, render_as_batch=True, version_table=VERSION_TABLE)
with context.begin_transaction():
    context.run_migrations()
