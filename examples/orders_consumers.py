"""Example consumers for ``topologies/orders.yml``: one per queue, ready to run.

    rabbit-retry apply topologies/orders.yml
    rabbit-retry worker examples.orders_consumers:FraudCheck -t topologies/orders.yml \
        --metrics-port 9100
    python -m examples.publish_orders            # publishes a few sample orders

``FraudCheck`` shows every path a message can take; the sample orders exercise each of them:

- a normal order is scored and acked;
- ``customer_id: "flaky"`` makes the (simulated) scoring service time out twice: the message
  is retried after 5s and 30s (the broker holds it meanwhile) and succeeds on attempt 3;
- ``customer_id: "ghost"`` raises ``UnknownCustomer``, listed in ``permanent_errors``: parked
  at once with reason ``permanent``;
- a body without ``total`` fails the ``OrderCreated`` model: parked ``invalid`` and the handler
  is never called;
- ``customer_id: "down"`` fails every time: retried after 5s, 30s, 5m and 5m, then parked
  ``exhausted`` with ``retry-count: 5``.

Inspect what was parked with ``rabbit-retry parking show orders.fraud-check``.
"""

from __future__ import annotations

import asyncio
import logging
from decimal import Decimal

from pydantic import BaseModel, Field

from rabbit_retry import Delivery, Permanent, RetryConsumer

log = logging.getLogger("examples.orders")


class OrderCreated(BaseModel):
    """What the checkout publishes to exchange ``orders`` with routing key ``order.created``."""

    order_id: str
    customer_id: str
    total: Decimal = Field(ge=0)
    currency: str = "EUR"


class ScoringUnavailable(Exception):
    """The scoring service did not answer: worth trying again later."""


class UnknownCustomer(Exception):
    """No such customer: trying again will not help."""


async def score(order: OrderCreated, attempt: int) -> float:
    """Stand-in for an HTTP call to a fraud-scoring service."""
    await asyncio.sleep(0.01)
    if order.customer_id == "ghost":
        raise UnknownCustomer(f"customer {order.customer_id!r} does not exist")
    if order.customer_id == "down" or (order.customer_id == "flaky" and attempt < 3):
        raise ScoringUnavailable("scoring service timed out")
    return 0.97 if order.total > 10_000 else 0.05


class FraudCheck(RetryConsumer):
    queue = "orders.fraud-check"
    prefetch = 50  # also how many orders are scored at once
    handler_timeout = 30.0  # a hung scoring call counts as a transient failure
    permanent_errors = (UnknownCustomer,)
    model = OrderCreated

    async def handle(self, delivery: Delivery) -> None:
        order: OrderCreated = delivery.payload
        risk = await score(order, delivery.attempt)
        if order.currency not in ("EUR", "USD"):
            raise Permanent(f"cannot score orders in {order.currency}")
        verdict = "hold" if risk > 0.9 else "accept"
        log.info(
            "order %s: risk %.2f -> %s (attempt %d/%d)",
            order.order_id,
            risk,
            verdict,
            delivery.attempt,
            delivery.max_attempts,
        )


class Inventory(RetryConsumer):
    """``orders.inventory`` gets both ``order.created`` and ``order.cancelled``."""

    queue = "orders.inventory"
    prefetch = 20
    handler_timeout = 10.0

    async def handle(self, delivery: Delivery) -> None:
        event = delivery.payload  # no model: the parsed JSON; a non-JSON body parks "invalid"
        # routing_key is where the event was first published, on retries too.
        if delivery.routing_key == "order.cancelled":
            log.info("release stock of order %s", event["order_id"])
        else:
            log.info("reserve stock for order %s", event["order_id"])
