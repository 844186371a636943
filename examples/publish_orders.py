"""Publishes one sample order per path ``FraudCheck`` can take (see ``orders_consumers``).

python -m examples.publish_orders   # RABBIT_RETRY_URL picks the broker and vhost
"""

from __future__ import annotations

import asyncio
import json
import os

import aio_pika

from rabbit_retry.settings import Settings

SAMPLES = [
    {"order_id": "o-1", "customer_id": "c-42", "total": "99.90"},  # acked at once
    {"order_id": "o-2", "customer_id": "flaky", "total": "15.00"},  # succeeds on attempt 3
    {"order_id": "o-3", "customer_id": "ghost", "total": "5.00"},  # parked: permanent
    {"order_id": "o-4", "customer_id": "c-7"},  # no total: parked invalid
    {"order_id": "o-5", "customer_id": "down", "total": "1.00"},  # parked: exhausted
]


async def main() -> None:
    settings = Settings.from_env(os.environ.get("RABBIT_RETRY_URL"))
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("orders", ensure=True)
        for sample in SAMPLES:
            await exchange.publish(
                aio_pika.Message(
                    json.dumps(sample).encode(),
                    content_type="application/json",
                    message_id=sample["order_id"],
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key="order.created",
            )
            print(f"published {sample['order_id']}")


if __name__ == "__main__":
    asyncio.run(main())
