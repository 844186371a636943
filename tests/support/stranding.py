"""Stranding a message the way docs/versions.md, "Stranded messages", says the broker does it:
returned past a quorum queue's delivery limit with no worker's verdict (test-only)."""

from __future__ import annotations

import asyncio
import time

import aio_pika

from rabbit_retry.settings import Settings

DEADLINE_S = 90.0


def stuck_topology(delivery_limit: int) -> str:
    """A queue ``stuck`` with one short tier and the broker's delivery limit at
    ``delivery_limit``: what the stranding tests declare."""
    return ("version: 1\nqueues:\n  stuck:\n    retry: {delays: [200ms], max_attempts: 3}\n"
            f"    arguments: {{x-delivery-limit: {delivery_limit}}}\n")
MAX_RETURNS = 50  # far above the test's x-delivery-limit of 1: the broker must have acted


async def return_until_dead_lettered(
    settings: Settings, queue: str, *, through_the_tier_first: bool = False,
    body: bytes = b"poison",
) -> int:
    """Publish one message to ``queue`` and requeue it (reject, requeue) until the broker's
    delivery limit dead-letters it; the number of deliveries seen. A reject, because since 4.3
    a nack(requeue) no longer counts towards the limit (docs/versions.md). With
    ``through_the_tier_first``, it is first nacked through the tier and back (once retried)."""
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue,
        )
        q = await channel.get_queue(queue, ensure=False)
        if through_the_tier_first:
            first = await q.get(no_ack=False)
            await first.nack(requeue=False)
        deliveries = 0
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and deliveries < MAX_RETURNS:
            message = await q.get(no_ack=False, fail=False)
            if message is None:
                if deliveries:
                    return deliveries
                await asyncio.sleep(0.05)
                continue
            deliveries += 1
            await message.reject(requeue=True)
        raise AssertionError(
            f"{queue}: still deliverable after {deliveries} deliveries, each rejected with "
            f"requeue: the broker's delivery limit never dead-lettered it (gave up at "
            f"{MAX_RETURNS} or after {DEADLINE_S}s)"
        )
