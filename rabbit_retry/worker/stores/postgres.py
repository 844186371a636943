"""The PostgreSQL idempotency store: one table shared by workers on any number of machines.

Times are the server's (``now()``), so workers with skewed clocks agree on what has expired.
A claim is one statement: insert the key, or take it over when the row found has expired;
when neither happened, one read says whether it is done or held.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import mask
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
    WHERE k.expires < now() OR k.token = EXCLUDED.token
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
            import psycopg  # noqa: F401
            import psycopg_pool  # noqa: F401
        except ImportError:
            raise InputError(
                "a postgresql:// idempotency store needs psycopg: "
                "pip install 'rabbit-retry[postgres]'"
            ) from None
        self._dsn = url
        self.url = mask(url)
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
            await pool.open(wait=True, timeout=CONNECT_TIMEOUT)
            # Two workers starting at once may both create the table: serialise them.
            async with pool.connection() as db, db.transaction():
                await db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (TABLE,))
                await db.execute(_CREATE)
        except (psycopg.Error, TimeoutError) as exc:
            await pool.close()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BrokerError(f"idempotency store {self.url}: {mask(reason)}") from None
        self._pool = pool

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        verdicts: dict[int, Claim] = {}
        todo = list(range(len(items)))
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
            await cursor.executemany(_DONE, items)

    async def release_many(self, items: list[Held]) -> None:
        async with self._pool.connection() as db, db.cursor() as cursor:
            await cursor.executemany(_RELEASE, items)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
