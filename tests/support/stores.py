"""The database servers the tests use (PostgreSQL, Redis), and throwaway PostgreSQL databases
(test-only, shared with bench/)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

POSTGRES_URL = os.environ.get("RABBIT_RETRY_TEST_POSTGRES_URL",
                              "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RABBIT_RETRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database on the test server, dropped afterwards."""
    import psycopg

    name = f"rr_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(POSTGRES_URL)
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
