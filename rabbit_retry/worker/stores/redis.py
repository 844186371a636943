"""The Redis idempotency store: one key per message key, its state in the value and its expiry
in Redis's own TTL (so nothing needs sweeping).

A claim is ``SET NX PX``; done and release check the claim's token inside a small Lua script, so
a worker whose claim ran out and was taken over cannot release the new holder's claim.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import mask
from rabbit_retry.worker.stores import Claim, Verdict

PREFIX = "rabbit-retry:idem:"
DONE = "done"
CONNECT_TIMEOUT = 10.0

# KEYS[1] the key; ARGV[1] the token. Only the holder's claim is dropped.
_RELEASE = """
if redis.call('GET', KEYS[1]) == 'claimed:' .. ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0"""


class RedisStore:
    def __init__(self, url: str) -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise InputError(
                "a redis:// idempotency store needs redis-py: pip install 'rabbit-retry[redis]'"
            ) from None
        self._dsn = url
        self.url = mask(url)
        self._client: Any = None
        self._release: Any = None

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
        self._release = client.register_script(_RELEASE)

    async def claim(self, scope: str, key: str, token: str, lease: float) -> Claim:
        name = self._name(scope, key)
        mine = f"claimed:{token}"
        while True:
            if await self._client.set(name, mine, nx=True, px=_ms(lease)):
                return Claim(Verdict.CLAIMED)
            async with self._client.pipeline(transaction=True) as pipe:
                value, left = await pipe.get(name).pttl(name).execute()
            if value is None:
                continue  # it expired or was released between the two: claim again
            if value == DONE:
                return Claim(Verdict.DUPLICATE)
            if value == mine:
                await self._client.pexpire(name, _ms(lease))
                return Claim(Verdict.CLAIMED)
            return Claim(Verdict.BUSY, max(left, 0) / 1000)

    async def done(self, scope: str, key: str, token: str, window: float) -> None:
        await self._client.set(self._name(scope, key), DONE, px=_ms(window))

    async def release(self, scope: str, key: str, token: str) -> None:
        await self._release(keys=[self._name(scope, key)], args=[token])

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
