"""The example topologies users copy: each loads, compiles, and says what its comments say."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from rabbit_retry.topology import Topology, compile_topology, load_topology
from rabbit_retry.topology.export import to_definitions, to_mermaid

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "topologies"
# ``examples`` is not an installed package: import it the way users run it, from the repo root.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import test_fraud_check, test_rewards_ledger, test_stock_loader  # noqa: E402


def load(name: str) -> Topology:
    return load_topology(EXAMPLES / name)


@pytest.mark.parametrize(
    "name",
    ["orders.yml", "notifications.yml", "audit.yml", "demo.yml", "rewards.yml", "warehouse.yml"],
)
def test_example_loads_compiles_and_exports(name: str) -> None:
    plan = compile_topology(load(name))
    assert plan.main_queues
    definitions = to_definitions(plan)
    assert len(definitions["queues"]) == len(plan.queues)
    assert to_mermaid(plan).startswith("flowchart LR\n")


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yml")) == [
        "audit.yml",
        "demo.yml",
        "notifications.yml",
        "orders.yml",
        "rewards.yml",
        "warehouse.yml",
    ]


def test_demo_retries_within_seconds() -> None:
    """The quick start's loop must show a retry and a park in seconds (its comment says 1 s)."""
    demo = load("demo.yml").queue("demo.orders")
    assert (demo.retry.tiers_ms, demo.retry.max_attempts) == ((1000, 3000), 3)


def test_orders() -> None:
    topology = load("orders.yml")
    assert [(e.name, e.type) for e in topology.exchanges] == [("orders", "topic")]
    fraud = topology.queue("orders.fraud-check")
    assert fraud.queue_type == "quorum"
    assert fraud.retry.delays_ms == (5_000, 30_000, 300_000)
    assert fraud.retry.max_attempts == 5
    # the comment's promise: after 5s, 30s, 5m and 5m again, then the 5th failure parks
    assert [fraud.retry.delay_for(f) for f in range(1, 5)] == [5_000, 30_000, 300_000, 300_000]
    assert [(b.exchange, b.routing_key) for b in fraud.bindings] == [("orders", "order.created")]
    inventory = topology.queue("orders.inventory")
    assert {b.routing_key for b in inventory.bindings} == {"order.created", "order.cancelled"}
    plan = compile_topology(topology)
    assert [q.name for q in plan.queues_of("orders.fraud-check")] == [
        "orders.fraud-check",
        "orders.fraud-check.retry.5s",
        "orders.fraud-check.retry.30s",
        "orders.fraud-check.retry.5m",
        "orders.fraud-check.parking",
    ]


def test_notifications() -> None:
    topology = load("notifications.yml")
    [email] = topology.queues
    assert (email.name, email.queue_type) == ("notifications.email", "classic")
    assert (email.retry.delays_ms, email.retry.max_attempts) == ((30_000,), 3)
    assert "x-overflow" not in email.arguments
    assert (email.on_full, email.dead_letter_route) == ("park", "parking")


def test_audit_fans_out_to_independent_queues() -> None:
    topology = load("audit.yml")
    assert [(e.name, e.type) for e in topology.exchanges] == [("audit", "fanout")]
    assert [q.name for q in topology.queues] == [
        "audit.archive",
        "audit.search-index",
        "audit.alerts",
    ]
    for queue in topology.queues:
        assert [b.exchange for b in queue.bindings] == ["audit"]
    assert topology.queue("audit.archive").retry.max_attempts == 8
    total = sum(topology.queue("audit.archive").retry.delay_for(f) for f in range(1, 8))
    assert 4 * 3_600_000 < total < 4.5 * 3_600_000  # "about four hours in all"
    plan = compile_topology(topology)
    # a tier returns a message to its own queue only, never through the fanout exchange
    for tier in (q for q in plan.queues if q.role == "tier"):
        assert tier.arguments["x-dead-letter-exchange"] == ""
        assert tier.arguments["x-dead-letter-routing-key"] == tier.owner


# --- "Testing your consumer" ---------------------------------------------------------------


def test_the_readme_shows_the_example_consumer_test_as_it_is() -> None:
    example = (ROOT / "examples" / "test_fraud_check.py").read_text()
    code = example.split('"""', 2)[2].lstrip("\n")  # the file without its docstring
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()


CONSUMER_TESTS = [f for name, f in vars(test_fraud_check).items() if name.startswith("test_")]


@pytest.mark.parametrize("case", CONSUMER_TESTS, ids=lambda f: f.__name__)
async def test_the_example_consumer_test_passes(
    case: Callable[[], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # it names topologies/orders.yml as a user's test would
    await case()


def test_every_example_consumer_test_is_run() -> None:
    assert len(CONSUMER_TESTS) == 4


# --- "Batch handlers" ----------------------------------------------------------------------


def test_the_readme_shows_the_batch_consumer_as_it_is() -> None:
    example = (ROOT / "examples" / "stock_loader.py").read_text()
    code = example.split('"""', 2)[2].lstrip("\n")
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()


async def test_the_batch_consumer_stores_the_known_and_parks_the_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    await test_stock_loader.test_a_batch_stores_the_known_and_parks_the_unknown(tmp_path)


def test_warehouse() -> None:
    movements = load("warehouse.yml").queue("warehouse.movements")
    # the comment's promise: 5 s, 1 m, 1 m, then parked
    assert [movements.retry.delay_for(f) for f in range(1, 4)] == [5_000, 60_000, 60_000]
    assert movements.retry.max_attempts == 4


# --- "Ordered keys" ------------------------------------------------------------------------


def test_the_readme_shows_the_ledger_and_its_topology_as_they_are() -> None:
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "rewards_ledger.py").read_text()
    code = example.split('"""', 2)[2].lstrip("\n")
    assert f"```python\n{code}```" in readme
    assert f"```yaml\n{(EXAMPLES / 'rewards.yml').read_text()}```" in readme


async def test_the_ledger_applies_each_users_events_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    await test_rewards_ledger.test_each_users_events_apply_in_order_through_a_retry(tmp_path)


def test_rewards() -> None:
    points = load("rewards.yml").queue("rewards.points")
    assert points.ordered is not None
    assert (points.ordered.header, points.ordered.lanes, points.ordered.on_park) == (
        "user-id", 8, "hold")
