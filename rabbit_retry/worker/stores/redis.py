"""The Redis idempotency store: one key per message key, its state in the value and its expiry
in Redis's own TTL (so nothing needs sweeping).

A claim is ``SET NX PX``; done and release check the claim's token inside a small Lua script, so
a worker whose claim ran out and was taken over cannot release the new holder's claim.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import mask, shown
from rabbit_retry.worker.stores import Claim, Held, Timed, Verdict

PREFIX = "rabbit-retry:idem:"
DONE = "done"
CONNECT_TIMEOUT = 10.0

# KEYS[1] the key; ARGV[1] the token, ARGV[2] the lease in ms. Free, expired or its own (renewed):
# claimed; else done, or busy for the milliseconds left. Atomic, so a renewal cannot extend a claim
# that ran out and was taken over between a read and a write.
_CLAIM = """
local value = redis.call('GET', KEYS[1])
if not value or value == 'claimed:' .. ARGV[1] then
    redis.call('SET', KEYS[1], 'claimed:' .. ARGV[1], 'PX', ARGV[2])
    return {0, 0}
elseif value == 'done' then
    return {1, 0}
end
return {2, redis.call('PTTL', KEYS[1])}"""
_VERDICTS = (
    lambda _: Claim(Verdict.CLAIMED),
    lambda _: Claim(Verdict.DUPLICATE),
    lambda left: Claim(Verdict.BUSY, max(left, 0) / 1000),
)

# KEYS[1] the key; ARGV[1] the token. Only the holder's claim is dropped.
_RELEASE = """
if redis.call('GET', KEYS[1]) == 'claimed:' .. ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0"""


class RedisBackend:
    def __init__(self, url: str) -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise InputError(
                "a redis:// idempotency store needs redis-py: pip install 'rabbit-retry[redis]'"
            ) from None
        self._dsn = url
        self.url = shown(url)
        self._client: Any = None

    @staticmethod
    def _name(scope: str, key: str) -> str:
        # The scope's length first: no (scope, key) pair can spell another's name.
        return f"{PREFIX}{len(scope)}:{scope}:{key}"

    async def open(self) -> None:
        import redis.asyncio
        from redis.exceptions import RedisError

        client = redis.asyncio.Redis.from_url(
            self._dsn, socket_connect_timeout=CONNECT_TIMEOUT, decode_responses=True
        )
        try:
            await client.ping()
        except (RedisError, OSError) as exc:
            await client.aclose()
            raise BrokerError(f"idempotency store {self.url}: {mask(str(exc))}") from None
        self._client = client

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        # One script per key, all in one round trip; a pipeline runs them in order. EVAL, not a
        # registered script: redis-py would ask SCRIPT EXISTS first, a second round trip.
        async with self._client.pipeline(transaction=False) as pipe:
            for scope, key, token, lease in items:
                pipe.eval(_CLAIM, 1, self._name(scope, key), token, _ms(lease))
            seen = await pipe.execute()
        return [_VERDICTS[code](left) for code, left in seen]

    async def done_many(self, items: list[Timed]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for scope, key, _token, window in items:
                pipe.set(self._name(scope, key), DONE, px=_ms(window))
            await pipe.execute()

    async def release_many(self, items: list[Held]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for scope, key, token in items:
                pipe.eval(_RELEASE, 1, self._name(scope, key), token)
            await pipe.execute()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
