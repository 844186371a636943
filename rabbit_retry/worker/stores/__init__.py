"""Idempotency stores: where a worker records which message keys it handled. ``open_store(url)``
picks the backend from the URL's scheme and wraps it in a ``Store``.

A key lives in a *scope* (the consumer's queue: the same message id fanned out to two queues is
handled once by each) and is, at any moment, absent, *claimed* by one worker until its lease
ends, or *done* until the dedupe window ends. The backends are imported only when used.

Each backend works in batches (``Backend``): the calls a worker's concurrent deliveries make
while one batch is on its way to the store become the next batch, one transaction or round
trip for all of them (a group commit). A lone call goes at once, so nothing waits for company.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rabbit_retry.errors import InputError

A = TypeVar("A")
R = TypeVar("R")

BATCH_LIMIT = 256  # calls in one batch at most


class Verdict(enum.Enum):
    CLAIMED = "claimed"  # ours now: run the handler, then ``done`` or ``release``
    DUPLICATE = "duplicate"  # handled successfully within the window: ack, do not handle
    BUSY = "busy"  # another worker holds it: ask again later


@dataclass(frozen=True, slots=True)
class Claim:
    verdict: Verdict
    # BUSY: seconds until the other worker's claim runs out (its lease), a bound for waiting.
    expires_in: float = 0.0


# (scope, key, token, lease or window in seconds) and (scope, key, token).
Timed = tuple[str, str, str, float]
Held = tuple[str, str, str]


class Backend(Protocol):
    """One kind of store, in batches. Shared safely by several worker processes (SQLite: on one
    machine); the calls of one batch are applied in order, so a key claimed twice in one batch
    is claimed once and found busy once."""

    url: str  # for logs: the password masked

    async def open(self) -> None:
        """Connect, create the table if missing; ``RabbitRetryError`` in one line if it cannot."""

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        """Per item, atomically: DUPLICATE if done within its window; BUSY if claimed by another
        token whose lease has not run out; else claim it for the token for ``lease`` seconds."""

    async def done_many(self, items: list[Timed]) -> None:
        """The handlers succeeded: each key is done for its window (whoever holds the claim:
        the side effect happened)."""

    async def release_many(self, items: list[Held]) -> None:
        """The handlers failed: drop each claim its token still holds."""

    async def close(self) -> None: ...


class _Coalescer(Generic[A, R]):
    """Runs ``run(items)`` for the calls that arrive while the previous batch runs."""

    def __init__(self, run: Callable[[list[A]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._pending: list[tuple[A, asyncio.Future[R]]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def submit(self, item: A) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:BATCH_LIMIT], self._pending[BATCH_LIMIT:]
            try:
                results = await self._run([item for item, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


class Store:
    """A backend behind one call per key, batched underneath."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._claims = _Coalescer(backend.claim_many)
        self._done = _Coalescer(_none_each(backend.done_many))
        self._releases = _Coalescer(_none_each(backend.release_many))

    @property
    def url(self) -> str:
        return self.backend.url

    async def open(self) -> None:
        await self.backend.open()

    async def claim(self, scope: str, key: str, token: str, lease: float) -> Claim:
        return await self._claims.submit((scope, key, token, lease))

    async def done(self, scope: str, key: str, token: str, window: float) -> None:
        await self._done.submit((scope, key, token, window))

    async def release(self, scope: str, key: str, token: str) -> None:
        await self._releases.submit((scope, key, token))

    async def close(self) -> None:
        await self.backend.close()


def _none_each(
    run: Callable[[list[A]], Awaitable[None]],
) -> Callable[[list[A]], Awaitable[list[None]]]:
    async def each(items: list[A]) -> list[None]:
        await run(items)
        return [None] * len(items)

    return each


def open_store(url: str) -> Store:
    """The store for ``url`` (``sqlite:///PATH``, ``postgresql://...``, ``redis://...``), not
    yet opened; ``InputError`` naming the URL's problem."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    backend: Backend
    if scheme == "sqlite":
        from rabbit_retry.worker.stores.sqlite import SQLiteBackend

        backend = SQLiteBackend(url)
    elif scheme in ("postgresql", "postgres"):
        from rabbit_retry.worker.stores.postgres import PostgresBackend

        backend = PostgresBackend(url)
    elif scheme in ("redis", "rediss"):
        from rabbit_retry.worker.stores.redis import RedisBackend

        backend = RedisBackend(url)
    else:
        raise InputError(
            f"idempotency store {url!r}: expected sqlite:///PATH, postgresql://... or redis://..."
        )
    return Store(backend)
