"""The whole loop in one process, for the quick start, on ``topologies/demo.yml`` (apply it
first). A shop service writes each order and its ``order.created`` event in one SQLite
transaction (``Outbox.add``); a fourth order's card is declined before it commits, so its
transaction rolls back and no event of it ever exists. The outbox relay publishes the three
committed events, with confirms; a worker handles them: one succeeds at once, one fails once and
is retried through the 1 s tier, one is declined for good and parks. Ends by itself once all
three are settled (or on Ctrl-C).

    python -m examples.demo     # RABBIT_RETRY_URL picks the broker and vhost
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

from rabbit_retry import Delivery, Permanent, RetryConsumer, Runner
from rabbit_retry.outbox import Outbox, Relay
from rabbit_retry.settings import Settings

TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "demo.yml"
QUEUE = "demo.orders"
SAMPLES = [
    {"id": "order-1", "customer": "alice"},  # succeeds at once
    {"id": "order-2", "customer": "flaky"},  # the gateway times out once: retried, then succeeds
    {"id": "order-3", "customer": "ghost"},  # no such customer: parked at once
    {"id": "order-4", "customer": "bob", "card": "declined"},  # rolled back: never published
]


class CardDeclined(Exception):
    pass


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


def take_orders(database: Path) -> None:
    """The shop service: each order and its event in one transaction, or neither."""
    outbox = Outbox(TOPOLOGY)  # events only to destinations the topology declares
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT)")
    for sample in SAMPLES:
        db = sqlite3.connect(database)
        try:
            with db:  # commits at the end of the block; an exception rolls it all back
                db.execute("INSERT INTO orders VALUES (?, ?)", (sample["id"], sample["customer"]))
                outbox.add(db, exchange="demo", routing_key="order.created",
                           body=json.dumps(sample), message_id=sample["id"],
                           key=sample["customer"], content_type="application/json")
                if sample.get("card") == "declined":
                    raise CardDeclined(sample["id"])
            print(f"  committed {sample['id']} ({sample['customer']}) and its event", flush=True)
        except CardDeclined:
            print(f"  rolled back {sample['id']}: card declined; no order, no event", flush=True)
        finally:
            db.close()


async def main(within: float = 60.0) -> int:
    settings = Settings.from_env(os.environ.get("RABBIT_RETRY_URL"))
    with tempfile.TemporaryDirectory(prefix="rabbit-retry-demo-") as scratch:
        shop = Path(scratch) / "shop.db"
        # The relay makes the outbox's tables in the shop's database when it starts.
        relay = Relay(f"sqlite:///{shop}", TOPOLOGY, settings)
        relaying = asyncio.create_task(relay.run())
        runner = Runner([Orders()], topology=TOPOLOGY, settings=settings, grace=5.0)
        worker = asyncio.create_task(runner.run())
        await runner.ready.wait()
        await asyncio.wait([asyncio.create_task(relay.ready.wait()), relaying],
                           return_when=asyncio.FIRST_COMPLETED)
        if relaying.done():
            relaying.result()
        await asyncio.to_thread(take_orders, shop)
        counts = runner.metrics.for_queue(QUEUE)  # what the metrics port would serve
        deadline = asyncio.get_running_loop().time() + within
        while counts.success < 2 or counts.parked < 1:
            if asyncio.get_running_loop().time() > deadline or worker.done():
                break
            await asyncio.sleep(0.2)
        settled = counts.success >= 2 and counts.parked >= 1
        runner.stop()
        relay.stop()
        await worker
        await relaying
    print(f"  the relay published {relay.published} events; {counts.success} succeeded, "
          f"{counts.parked} parked", flush=True)
    return 0 if settled else 1


class _Said(logging.Formatter):
    """The worker's lines as ``worker: ...``; the relay's say ``relay:`` themselves."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return f"  {text}" if text.startswith("relay:") else f"  worker: {text}"


if __name__ == "__main__":
    said = logging.StreamHandler(sys.stdout)
    said.setFormatter(_Said())
    logging.basicConfig(level=logging.INFO, handlers=[said])
    for quiet in ("aiormq", "alembic"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
