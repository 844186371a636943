"""The outbox's Alembic migrations (run by ``rabbit-retry relay`` at start)."""
