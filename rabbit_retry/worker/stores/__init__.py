"""Idempotency stores: where a worker records which message keys it handled, behind one small
interface (``Store``); ``open_store(url)`` picks the backend from the URL's scheme.

A key lives in a *scope* (the consumer's queue: the same message id fanned out to two queues is
handled once by each) and is, at any moment, absent, *claimed* by one worker until its lease
ends, or *done* until the dedupe window ends. The backends are imported only when used.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from rabbit_retry.errors import InputError


class Verdict(enum.Enum):
    CLAIMED = "claimed"  # ours now: run the handler, then ``done`` or ``release``
    DUPLICATE = "duplicate"  # handled successfully within the window: ack, do not handle
    BUSY = "busy"  # another worker holds it: ask again later


@dataclass(frozen=True, slots=True)
class Claim:
    verdict: Verdict
    # BUSY: seconds until the other worker's claim runs out (its lease), a bound for waiting.
    expires_in: float = 0.0


class Store(Protocol):
    """One backend. Every method is safe to call concurrently from one event loop, and the
    store is shared safely by several worker processes (SQLite: on one machine)."""

    url: str  # as given, for logs (``open_store`` masks passwords)

    async def open(self) -> None:
        """Connect, create the table if missing; ``RabbitRetryError`` in one line if it cannot."""

    async def claim(self, scope: str, key: str, token: str, lease: float) -> Claim:
        """Atomically: DUPLICATE if done within its window; BUSY if claimed by another token
        whose lease has not run out; else claim it for ``token`` for ``lease`` seconds."""

    async def done(self, scope: str, key: str, token: str, window: float) -> None:
        """The handler succeeded: the key is done for ``window`` seconds (only if ``token``
        still holds the claim; otherwise record done anyway: the side effect happened)."""

    async def release(self, scope: str, key: str, token: str) -> None:
        """The handler failed: drop the claim if ``token`` still holds it."""

    async def close(self) -> None: ...


SCHEMES = ("sqlite", "postgresql", "redis")


def open_store(url: str) -> Store:
    """The backend for ``url`` (``sqlite:///PATH``, ``postgresql://...``, ``redis://...``),
    not yet opened; ``InputError`` naming the URL's problem."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        from rabbit_retry.worker.stores.sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("postgresql", "postgres"):
        from rabbit_retry.worker.stores.postgres import PostgresStore

        return PostgresStore(url)
    if scheme in ("redis", "rediss"):
        from rabbit_retry.worker.stores.redis import RedisStore

        return RedisStore(url)
    raise InputError(
        f"idempotency store {url!r}: expected sqlite:///PATH, postgresql://... or redis://..."
    )
