"""The whole loop in one process, for the quick start: a worker handles three sample orders on
``topologies/demo.yml`` (apply it first): one succeeds at once, one fails once and is retried
through the 1 s tier, one is declined for good and parks. Ends by itself once all three are
settled (or on Ctrl-C).

    python -m examples.demo     # RABBIT_RETRY_URL picks the broker and vhost
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import aio_pika

from rabbit_retry import Delivery, Permanent, RetryConsumer, Runner
from rabbit_retry.settings import Settings

TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "demo.yml"
QUEUE = "demo.orders"
SAMPLES = [
    {"id": "order-1", "customer": "alice"},  # succeeds at once
    {"id": "order-2", "customer": "flaky"},  # the gateway times out once: retried, then succeeds
    {"id": "order-3", "customer": "ghost"},  # no such customer: parked at once
]


class Orders(RetryConsumer):
    queue = QUEUE
    prefetch = 10

    async def handle(self, delivery: Delivery) -> None:
        order = delivery.payload
        if order["customer"] == "flaky" and delivery.attempt == 1:
            raise ConnectionError("payment gateway timed out")
        if order["customer"] == "ghost":
            raise Permanent(f"customer {order['customer']!r} does not exist")
        print(f"  handled {order['id']} at attempt {delivery.attempt}", flush=True)


async def publish(settings: Settings) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("demo", ensure=True)
        for sample in SAMPLES:
            message = aio_pika.Message(json.dumps(sample).encode(), message_id=sample["id"],
                                       content_type="application/json",
                                       delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await exchange.publish(message, routing_key="order.created")
            print(f"  published {sample['id']} ({sample['customer']})", flush=True)


async def main(within: float = 60.0) -> int:
    settings = Settings.from_env(os.environ.get("RABBIT_RETRY_URL"))
    runner = Runner([Orders()], topology=TOPOLOGY, settings=settings, grace=5.0)
    worker = asyncio.create_task(runner.run())
    await runner.ready.wait()
    await publish(settings)
    counts = runner.metrics.for_queue(QUEUE)  # what the metrics port would serve
    deadline = asyncio.get_running_loop().time() + within
    while counts.success < 2 or counts.parked < 1:
        if asyncio.get_running_loop().time() > deadline or worker.done():
            break
        await asyncio.sleep(0.2)
    settled = counts.success >= 2 and counts.parked >= 1
    runner.stop()
    await worker
    print(f"  {counts.success} succeeded, {counts.parked} parked", flush=True)
    return 0 if settled else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="  worker: %(message)s", stream=sys.stdout)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
