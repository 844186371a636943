"""Testing a consumer without RabbitMQ: an in-memory broker that runs the real worker.

``TestBroker`` applies a topology file to an in-memory RabbitMQ (exchanges, classic and quorum
queues, bindings, retry tiers, parking queues: what ``rabbit-retry apply`` creates), runs the
consumers through the production worker (its session, lanes and publisher), and shows what the
worker decided for each delivery::

    from rabbit_retry.testing import TestBroker

    async def test_a_gateway_timeout_is_retried() -> None:
        async with TestBroker("topologies/orders.yml") as broker, \\
                broker.worker(FraudCheck(gateway=Down())):
            broker.publish(json={"order": 7}, exchange="orders", routing_key="order.created")
            [decision] = await broker.settle()
        assert decision.verdict == "retried"
        assert decision.tier == "orders.fraud-check.retry.5s"
        assert decision.headers["retry-count"] == 1

Retry delays run on a virtual clock: ``advance(seconds)`` moves it, ``settle(retries=True)``
runs every retry to its end; no test sleeps through a delay. ``version`` picks the RabbitMQ
whose dead-lettering headers and redelivery counts to follow (``"3.10"``, ``"4.0"``, ``"4.3"``).
``SyncTestBroker`` is the same for synchronous tests.

Modules: ``harness`` (the broker a test drives, decisions), ``memory`` (the in-memory RabbitMQ),
``amqp`` (aiormq's connection and channel over it), ``frames`` (what crosses its wire).
"""

from rabbit_retry.testing.harness import (
    Decision,
    Message,
    SettleTimeout,
    SyncTestBroker,
    TestBroker,
    Unroutable,
    Verdict,
    Worker,
)
from rabbit_retry.testing.memory import VERSIONS, Discarded

__all__ = [
    "VERSIONS",
    "Decision",
    "Discarded",
    "Message",
    "SettleTimeout",
    "SyncTestBroker",
    "TestBroker",
    "Unroutable",
    "Verdict",
    "Worker",
]
