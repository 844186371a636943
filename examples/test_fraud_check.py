"""How a service tests its consumer without RabbitMQ: ``FraudCheck`` (examples/orders_consumers.py)
against ``topologies/orders.yml`` on the in-memory broker (pytest with pytest-asyncio, run from
the repository root: ``pytest examples/test_fraud_check.py``). The README shows this file."""

from examples.orders_consumers import FraudCheck
from rabbit_retry.testing import TestBroker

ORDER = {"order_id": "o-1", "customer_id": "c-42", "total": "99.90"}


async def test_an_order_is_scored_and_acked() -> None:
    async with TestBroker("topologies/orders.yml") as broker, broker.worker(FraudCheck()):
        broker.publish(json=ORDER, exchange="orders", routing_key="order.created")
        [decision] = await broker.settle()
    assert decision.verdict == "acked"


async def test_a_flaky_scoring_service_is_retried_until_it_answers() -> None:
    async with TestBroker("topologies/orders.yml") as broker, broker.worker(FraudCheck()):
        flaky = {**ORDER, "customer_id": "flaky"}  # times out on attempts 1 and 2
        broker.publish(json=flaky, exchange="orders", routing_key="order.created")
        first, second, third = await broker.settle(retries=True)  # every delay runs out
    assert (first.verdict, first.tier) == ("retried", "orders.fraud-check.retry.5s")
    assert second.tier == "orders.fraud-check.retry.30s"
    assert second.headers["retry-count"] == 2
    assert third.verdict == "acked"


async def test_an_unknown_customer_is_parked_at_once() -> None:
    async with TestBroker("topologies/orders.yml") as broker, broker.worker(FraudCheck()):
        ghost = {**ORDER, "customer_id": "ghost"}
        broker.publish(json=ghost, exchange="orders", routing_key="order.created")
        [decision] = await broker.settle()
        [parked] = broker.parked("orders.fraud-check")
    assert (decision.verdict, decision.reason) == ("parked", "permanent")
    assert decision.headers["exception-type"] == "examples.orders_consumers.UnknownCustomer"
    assert parked.json() == ghost


async def test_an_order_without_a_total_is_parked_without_calling_the_handler() -> None:
    async with TestBroker("topologies/orders.yml") as broker, broker.worker(FraudCheck()):
        broker.publish(json={"order_id": "o-2", "customer_id": "c-7"},
                       exchange="orders", routing_key="order.created")
        [decision] = await broker.settle()
    assert decision.reason == "invalid"
    assert "total" in decision.headers["exception-message"]
