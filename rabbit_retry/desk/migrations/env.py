"""Alembic's entry point for the desk's store: migrations run on the connection the desk hands
over (``config.attributes["connection"]``), never from a URL in a file."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
