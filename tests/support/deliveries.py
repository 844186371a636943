"""What a real broker writes on a quorum queue's deliveries as a message comes back in the ways
a worker meets: the source of the per-version fixtures in tests/unit/fixtures/ (test-only).

    python -m tests.support.deliveries URL     # prints the capture as JSON

The integration test ``test_redelivery_fixtures`` recaptures on the broker under test and
compares with the fixture of its version, so the fixtures stay what the brokers really do; the
unit test ``test_testing_broker`` runs the same capture on ``rabbit_retry.testing``'s in-memory
broker, so it counts as the real ones do.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiormq
from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

# Each step acts on the delivery in hand, then the message is consumed again and recorded.
STEPS = (
    "native",  # nack(requeue=False): dead-lettered through a 100 ms quorum tier back to Q
    "close",  # the consumer's channel closes with it unacked (a crashed worker)
    "close",
    "native",  # the broker's nack cycle from a non-zero count
    "nack-requeue",  # consumer cancelled first, so the requeue is not redelivered at once
    "reject-requeue",
    "close",
)
# The same cycle through basic.reject(requeue=False), on a second message: what a consumer
# other than the worker (one that rejects rather than nacks) does to the counts.
REJECT_STEPS = (
    "reject",  # from a count of 0
    "reject",
    "close",
    "reject",  # from a non-zero count
)
RECORDED = ("x-delivery-count", "x-acquired-count")


def summary(message: DeliveredMessage) -> dict[str, Any]:
    headers = dict(message.header.properties.headers or {})
    deaths = headers.get("x-death") or []
    return {
        "redelivered": bool(getattr(message.delivery, "redelivered", False)),
        "headers": {k: headers[k] for k in RECORDED if k in headers},
        "x-death": sorted(
            f"{d.get('queue')}:{d.get('reason')}:{d.get('count')}" for d in deaths
        ),
    }


async def _declare(channel: AbstractChannel, queue: str) -> None:
    quorum = {
        "x-queue-type": "quorum",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    await channel.exchange_declare(f"{queue}.retry", exchange_type="direct", durable=True)
    await channel.queue_declare(
        queue,
        durable=True,
        arguments={
            **quorum,
            "x-dead-letter-exchange": f"{queue}.retry",
            "x-dead-letter-routing-key": queue,
        },
    )
    await channel.queue_declare(
        f"{queue}.tier",
        durable=True,
        arguments={
            **quorum,
            "x-message-ttl": 100,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": queue,
        },
    )
    await channel.queue_bind(f"{queue}.tier", f"{queue}.retry", routing_key=queue)


async def _real_time() -> None:
    """On a real broker the tier's 100 ms pass while the capture waits for the message."""


async def _take(
    connection: AbstractConnection, queue: str, tier_passes: Callable[[], Awaitable[None]]
) -> tuple[AbstractChannel, str, DeliveredMessage]:
    channel = await connection.channel()
    await channel.basic_qos(prefetch_count=1)
    got: asyncio.Queue[DeliveredMessage] = asyncio.Queue()

    async def put(message: DeliveredMessage) -> None:
        got.put_nowait(message)

    ok = await channel.basic_consume(queue, put)
    await tier_passes()
    message = await asyncio.wait_for(got.get(), 30)
    return channel, str(ok.consumer_tag), message


async def capture(url: str) -> dict[str, Any]:
    """Runs ``STEPS`` on one message and ``REJECT_STEPS`` on another, each in a throwaway queue
    of ``url``'s vhost."""
    return await capture_on(await aiormq.connect(url))


async def capture_on(
    connection: AbstractConnection,
    tier_passes: Callable[[], Awaitable[None]] = _real_time,
) -> dict[str, Any]:
    """``capture`` on an open ``connection`` (closed at the end); ``tier_passes`` lets the
    tier's TTL run out where time does not pass by itself."""
    try:
        version = (connection.server_properties or {}).get("version")
        return {
            "version": version.decode() if isinstance(version, bytes) else version,
            "deliveries": await _run(connection, STEPS, tier_passes),
            "rejects": await _run(connection, REJECT_STEPS, tier_passes),
        }
    finally:
        await connection.close()


async def _run(
    connection: AbstractConnection,
    steps: tuple[str, ...],
    tier_passes: Callable[[], Awaitable[None]],
) -> list[dict[str, Any]]:
    queue = f"rr-capture-{uuid.uuid4().hex[:8]}"
    admin = await connection.channel()
    try:
        await _declare(admin, queue)
        await admin.basic_publish(
            b"{}", routing_key=queue, properties=aiormq.spec.Basic.Properties(delivery_mode=2)
        )
        channel, tag, message = await _take(connection, queue, tier_passes)
        seen = [{"after": "publish", **summary(message)}]
        for step in steps:
            delivery_tag = message.delivery.delivery_tag  # type: ignore[union-attr]
            if step == "native":
                await channel.basic_nack(delivery_tag, requeue=False)
            elif step == "reject":
                await channel.basic_reject(delivery_tag, requeue=False)
            elif step in ("nack-requeue", "reject-requeue"):
                await channel.basic_cancel(tag)
                if step == "nack-requeue":
                    await channel.basic_nack(delivery_tag, requeue=True)
                else:
                    await channel.basic_reject(delivery_tag, requeue=True)
            await channel.close()  # "close": with the delivery still unacked
            channel, tag, message = await _take(connection, queue, tier_passes)
            seen.append({"after": step, **summary(message)})
        await channel.basic_ack(message.delivery.delivery_tag)  # type: ignore[union-attr]
        await channel.close()
        return [_rename(s, queue) for s in seen]
    finally:
        for name in (queue, f"{queue}.tier"):
            await admin.queue_delete(name)
        await admin.exchange_delete(f"{queue}.retry")
        await admin.close()


def _rename(seen: dict[str, Any], queue: str) -> dict[str, Any]:
    """Queue names made stable, so captures of different runs compare equal."""
    seen["x-death"] = [
        d.replace(f"{queue}.tier", "TIER").replace(queue, "Q") for d in seen["x-death"]
    ]
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(capture(sys.argv[1])), indent=2))
