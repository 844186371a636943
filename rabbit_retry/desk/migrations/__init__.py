"""The desk store's Alembic migrations (run by ``rabbit-retry desk`` at start)."""
