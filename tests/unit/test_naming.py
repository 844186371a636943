"""Derived names (rabbit_retry.topology.naming): from ``Q`` to its objects, and back."""

from __future__ import annotations

import pytest

from rabbit_retry.topology import naming


def test_the_names_one_queue_derives() -> None:
    assert naming.retry_exchange("orders") == "orders.retry"
    assert naming.tier_queue("orders", 90_000) == "orders.retry.90s"
    assert naming.tier_routing_key(90_000) == "90s"
    assert naming.tier_queue("orders", 1_500) == naming.tier_prefix("orders") + "1500ms"
    assert naming.parking_queue("orders") == "orders.parking"


@pytest.mark.parametrize(
    ("name", "retry_owner", "parking_owner"),
    [
        ("orders.retry", "orders", None),
        ("orders.parking", None, "orders"),
        ("a.retry.retry", "a.retry", None),
        (".retry", None, None),
        ("orders", None, None),
    ],
)
def test_main_queue_back_from_a_derived_name(
    name: str, retry_owner: str | None, parking_owner: str | None
) -> None:
    assert naming.main_queue_of_retry_exchange(name) == retry_owner
    assert naming.main_queue_of_parking(name) == parking_owner


@pytest.mark.parametrize(
    ("name", "owner", "tier_label"),
    [
        ("orders.retry.5s", "orders", "5s"),
        ("orders.retry.5000ms", "orders", None),  # not the canonical label of 5s
        ("orders.retry.soon", "orders", None),
        ("other.retry.5s", "orders", None),
    ],
)
def test_tier_label_of(name: str, owner: str, tier_label: str | None) -> None:
    assert naming.tier_label_of(name, owner) == tier_label


def test_tier_namespace_owners_shortest_first() -> None:
    assert naming.tier_namespace_owners("a.retry.b.retry.5s") == ["a", "a.retry.b"]
    assert naming.tier_namespace_owners(".retry.x.retry.5s") == [".retry.x"]
    assert naming.tier_namespace_owners("orders.parking") == []
