"""The PostgreSQL idempotency store: one table shared by workers on any number of machines.

Times are the server's (``now()``), so workers with skewed clocks agree on what has expired.
A claim is one statement: insert the key, or take it over when the row found has expired;
when neither happened, one read says whether it is done or held.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import mask, shown
from rabbit_retry.worker.stores import Claim, Held, Timed, Verdict

TABLE = "rabbit_retry_keys"
POOL_SIZE = 4
CONNECT_TIMEOUT = 10.0
SWEEP_EVERY = 1000  # claims between deletions of expired rows

_CREATE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    scope text NOT NULL,
    key text NOT NULL,
    done boolean NOT NULL,
    token text NOT NULL,
    expires timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
)"""
_CLAIM = f"""
INSERT INTO {TABLE} AS k (scope, key, done, token, expires)
VALUES (%s, %s, false, %s, now() + make_interval(secs => %s))
ON CONFLICT (scope, key) DO UPDATE
    SET done = false, token = EXCLUDED.token, expires = EXCLUDED.expires
    WHERE k.expires < now() OR (k.token = EXCLUDED.token AND NOT k.done)
RETURNING 1"""
_LOOK = f"""
SELECT done, extract(epoch FROM expires - now()) FROM {TABLE}
WHERE scope = %s AND key = %s AND expires >= now()"""
_DONE = f"""
INSERT INTO {TABLE} (scope, key, done, token, expires)
VALUES (%s, %s, true, %s, now() + make_interval(secs => %s))
ON CONFLICT (scope, key) DO UPDATE
    SET done = true, token = EXCLUDED.token, expires = EXCLUDED.expires"""
_RELEASE = f"DELETE FROM {TABLE} WHERE scope = %s AND key = %s AND token = %s AND NOT done"
_SWEEP = f"DELETE FROM {TABLE} WHERE expires < now()"


class PostgresBackend:
    def __init__(self, url: str) -> None:
        try:
            import psycopg
            import psycopg_pool  # noqa: F401
        except ImportError:
            raise InputError(
                "a postgresql:// idempotency store needs psycopg: "
                "pip install 'rabbit-retry[postgres]'"
            ) from None
        from psycopg.conninfo import conninfo_to_dict

        self._dsn = url
        self.url = shown(url)
        try:
            conninfo_to_dict(url)
        except psycopg.Error as exc:  # its message quotes the URL
            raise InputError(f"idempotency store {self.url}: {_line(exc)}") from None
        self._pool: Any = None
        self._claims = 0

    async def open(self) -> None:
        import psycopg
        from psycopg_pool import AsyncConnectionPool

        pool = AsyncConnectionPool(
            self._dsn,
            min_size=1,
            max_size=POOL_SIZE,
            kwargs={"autocommit": True},
            open=False,
            timeout=CONNECT_TIMEOUT,
        )
        try:
            # One connection first: the pool would only say it timed out, this says why.
            first = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(self._dsn), CONNECT_TIMEOUT
            )
            await first.close()
            await pool.open(wait=True, timeout=CONNECT_TIMEOUT)
            # Two workers starting at once may both create the table: serialise them.
            async with pool.connection() as db, db.transaction():
                await db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (TABLE,))
                await db.execute(_CREATE)
        except (psycopg.Error, TimeoutError) as exc:
            await pool.close()
            raise BrokerError(f"idempotency store {self.url}: {_line(exc)}") from None
        self._pool = pool

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        verdicts: dict[int, Claim] = {}
        # Rows are locked in (scope, key) order by every worker, so two batches cannot deadlock;
        # the sort is stable, so the calls on one key keep their order.
        todo = sorted(range(len(items)), key=lambda i: items[i][:2])
        async with self._pool.connection() as db:
            while todo:
                # One round trip per pass; the statements run in order, in one transaction.
                async with db.pipeline():
                    claims = [await db.execute(_CLAIM, items[i]) for i in todo]
                looks = []
                for i, cursor in zip(todo, claims, strict=True):
                    if await cursor.fetchone():
                        verdicts[i] = Claim(Verdict.CLAIMED)
                    else:
                        looks.append(i)
                async with db.pipeline():
                    cursors = [await db.execute(_LOOK, items[i][:2]) for i in looks]
                todo = []
                for i, cursor in zip(looks, cursors, strict=True):
                    row = await cursor.fetchone()
                    if row is None:  # expired or released between the two: claim again
                        todo.append(i)
                    else:
                        done, left = row
                        verdicts[i] = (
                            Claim(Verdict.DUPLICATE) if done else Claim(Verdict.BUSY, float(left))
                        )
            self._claims += len(items)
            if self._claims >= SWEEP_EVERY:
                self._claims = 0
                await db.execute(_SWEEP)
        return [verdicts[i] for i in range(len(items))]

    async def done_many(self, items: list[Timed]) -> None:
        async with self._pool.connection() as db, db.cursor() as cursor:
            await cursor.executemany(_DONE, sorted(items, key=lambda item: item[:2]))

    async def release_many(self, items: list[Held]) -> None:
        async with self._pool.connection() as db, db.cursor() as cursor:
            await cursor.executemany(_RELEASE, sorted(items))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def _line(exc: BaseException) -> str:
    """The first line of an error's message, without a password it may quote."""
    text = str(exc).strip()
    return mask(text.splitlines()[0]) if text else type(exc).__name__
