"""The example consumers of ``examples/`` against ``topologies/orders.yml``, as shipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.amqp import depth, drain, publish
from support.poll import eventually
from support.provision import provision
from support.worker import running, scraped

from rabbit_retry.metric_names import MESSAGES
from rabbit_retry.settings import Settings
from rabbit_retry.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
ORDERS = ROOT / "topologies" / "orders.yml"
# ``examples`` is not an installed package: import it the way users run it, from the repo root.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.orders_consumers import FraudCheck, Inventory  # noqa: E402


async def test_example_consumers_handle_and_park_sample_orders(fresh_vhost: Settings) -> None:
    topo = load_topology(ORDERS)
    await provision(fresh_vhost, topo)
    samples = {
        "o-1": {"order_id": "o-1", "customer_id": "c-42", "total": "99.90"},
        "o-3": {"order_id": "o-3", "customer_id": "ghost", "total": "5.00"},
        "o-4": {"order_id": "o-4", "customer_id": "c-7"},
    }
    async with running([FraudCheck(), Inventory()], topo, fresh_vhost) as runner:
        for order_id, sample in samples.items():
            await publish(
                fresh_vhost,
                json.dumps(sample).encode(),
                exchange="orders",
                routing_key="order.created",
                message_id=order_id,
            )
        await eventually(
            lambda: depth(fresh_vhost, "orders.fraud-check.parking"),
            what="fraud-check parked something",
        )

        async def settled() -> bool:
            return (
                scraped(runner, MESSAGES, "orders.inventory", "success") == 3
                and scraped(runner, MESSAGES, "orders.fraud-check", "success") == 1
                and await depth(fresh_vhost, "orders.fraud-check.parking") == 2
            )

        await eventually(settled, what="every sample settled")
    parked = {
        m.message_id: m.headers
        for m in await drain(fresh_vhost, "orders.fraud-check.parking")
    }
    assert parked["o-3"]["parked-reason"] == "permanent"
    assert parked["o-3"]["exception-type"] == "examples.orders_consumers.UnknownCustomer"
    assert parked["o-4"]["parked-reason"] == "invalid"
    for queue in ("orders.fraud-check", "orders.inventory", "orders.inventory.parking"):
        assert await depth(fresh_vhost, queue) == 0, queue


async def test_the_quick_start_demo_retries_one_parks_one_and_ends_by_itself(
    fresh_vhost: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples import demo

    monkeypatch.setenv("RABBIT_RETRY_URL", fresh_vhost.url)
    await provision(fresh_vhost, load_topology(ROOT / "topologies" / "demo.yml"))
    assert await demo.main(within=60) == 0
    parked = await drain(fresh_vhost, "demo.orders.parking")
    assert [m.message_id for m in parked] == ["order-3"]
    assert await depth(fresh_vhost, "demo.orders") == 0
