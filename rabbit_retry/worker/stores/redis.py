"""The Redis idempotency store: one key per message key, its state in the value and its expiry
in Redis's own TTL (so nothing needs sweeping).

A claim is ``SET NX PX``; done and release check the claim's token inside a small Lua script, so
a worker whose claim ran out and was taken over cannot release the new holder's claim.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import mask
from rabbit_retry.worker.stores import Claim, Held, Timed, Verdict

PREFIX = "rabbit-retry:idem:"
DONE = "done"
CONNECT_TIMEOUT = 10.0

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

    async def claim_many(self, items: list[Timed]) -> list[Claim]:
        verdicts: dict[int, Claim] = {}
        todo = list(range(len(items)))
        while todo:
            # One round trip per pass; a pipeline runs its commands in order.
            async with self._client.pipeline(transaction=False) as pipe:
                for i in todo:
                    scope, key, token, lease = items[i]
                    pipe.set(self._name(scope, key), f"claimed:{token}", nx=True, px=_ms(lease))
                taken = await pipe.execute()
            looks = [i for i, ok in zip(todo, taken, strict=True) if not ok]
            verdicts.update((i, Claim(Verdict.CLAIMED)) for i, ok in zip(todo, taken,
                                                                         strict=True) if ok)
            async with self._client.pipeline(transaction=False) as pipe:
                for i in looks:
                    name = self._name(*items[i][:2])
                    pipe.get(name).pttl(name)
                seen = await pipe.execute()
            todo = []
            for n, i in enumerate(looks):
                value, left = seen[2 * n], seen[2 * n + 1]
                if value is None:  # expired or released between the two: claim again
                    todo.append(i)
                elif value == DONE:
                    verdicts[i] = Claim(Verdict.DUPLICATE)
                elif value == f"claimed:{items[i][2]}":  # its own claim: extend it
                    await self._client.pexpire(self._name(*items[i][:2]), _ms(items[i][3]))
                    verdicts[i] = Claim(Verdict.CLAIMED)
                else:
                    verdicts[i] = Claim(Verdict.BUSY, max(left, 0) / 1000)
        return [verdicts[i] for i in range(len(items))]

    async def done_many(self, items: list[Timed]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for scope, key, _token, window in items:
                pipe.set(self._name(scope, key), DONE, px=_ms(window))
            await pipe.execute()

    async def release_many(self, items: list[Held]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for scope, key, token in items:
                await self._release(keys=[self._name(scope, key)], args=[token], client=pipe)
            await pipe.execute()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
