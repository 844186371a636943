"""The SQLite idempotency store: one file, shared by the workers of one machine.

Every call runs on one thread of the store's own, so the event loop never waits on the disk.
``BEGIN IMMEDIATE`` takes the write lock before reading, so two processes claiming one key see
each other's claim; WAL lets readers and the one writer go on side by side.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.worker.stores import Claim, Held, Timed, Verdict

T = TypeVar("T")

TABLE = "rabbit_retry_keys"
SWEEP_EVERY = 60.0  # seconds between deletions of rows past their expiry
BUSY_TIMEOUT_MS = 30_000


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, its lock taken before the first read."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class SQLiteBackend:
    def __init__(self, url: str) -> None:
        self.url = url
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise InputError(f"idempotency store {url!r}: expected sqlite:///PATH")
        self.path = path[1:] if path != "/:memory:" else ":memory:"
        if self.path != ":memory:":
            parent = Path(self.path).expanduser().resolve().parent
            if not parent.is_dir():
                raise InputError(f"idempotency store {url!r}: directory {parent} does not exist")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rabbit-retry-sqlite")
        self._db: sqlite3.Connection | None = None
        self._swept = 0.0

    async def _run(self, call: Callable[[sqlite3.Connection], T]) -> T:
        db = self._db
        assert db is not None, "open() first"
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, db)

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at each checkpoint
            db.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (scope TEXT NOT NULL, key TEXT NOT NULL,"
                " done INTEGER NOT NULL, token TEXT NOT NULL, expires REAL NOT NULL,"
                " PRIMARY KEY (scope, key)) WITHOUT ROWID"
            )
            return db

        loop = asyncio.get_running_loop()
        try:
            self._db = await loop.run_in_executor(self._thread, connect)
        except sqlite3.Error as exc:
            raise BrokerError(f"idempotency store {self.url}: {exc}") from None

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        def claim(db: sqlite3.Connection) -> list[Claim]:
            now = time.time()
            verdicts = []
            with _transaction(db):
                for scope, key, token, lease in items:
                    row = db.execute(
                        f"SELECT done, token, expires FROM {TABLE} WHERE scope = ? AND key = ?",
                        (scope, key),
                    ).fetchone()
                    if row is not None and row[2] > now and (row[1] != token or row[0]):
                        done, _, expires = row
                        busy = Claim(Verdict.BUSY, expires - now)
                        verdicts.append(Claim(Verdict.DUPLICATE) if done else busy)
                        continue
                    db.execute(
                        f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, 0, ?, ?)",
                        (scope, key, token, now + lease),
                    )
                    verdicts.append(Claim(Verdict.CLAIMED))
                if now - self._swept > SWEEP_EVERY:
                    self._swept = now
                    db.execute(f"DELETE FROM {TABLE} WHERE expires < ?", (now,))
            return verdicts

        return await self._run(claim)

    async def done_many(self, items: list[Timed]) -> None:
        def done(db: sqlite3.Connection) -> None:
            now = time.time()
            with _transaction(db):
                db.executemany(
                    f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, 1, ?, ?)",
                    [(scope, key, token, now + window) for scope, key, token, window in items],
                )

        await self._run(done)

    async def release_many(self, items: list[Held]) -> None:
        def release(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.executemany(
                    f"DELETE FROM {TABLE} WHERE scope = ? AND key = ? AND token = ? AND done = 0",
                    items,
                )

        await self._run(release)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(lambda db: db.close())
            self._db = None
        self._thread.shutdown(wait=False)
