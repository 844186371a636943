"""Parking follows the main queue, an existing classic parking queue does not block apply, and
queues that live on one node of a cluster are named; without a broker."""

from __future__ import annotations

import dataclasses

from rabbit_retry.broker.diff import (
    blocking,
    deferred,
    deferred_notes,
    diff,
    nothing_to_do,
    refusal,
)
from rabbit_retry.broker.inspect import LivePolicy, LiveState
from rabbit_retry.broker.placement import single_node_notes
from tests.unit.test_diff import live_of, live_queue, plan_of

NODES = ("r1@h", "r2@h", "r3@h")
QUORUM_ONLY = "version: 1\nqueues:\n  orders: {retry: {delays: [5s]}}\n"


def _with_classic_parking(text: str = QUORUM_ONLY) -> LiveState:
    """The broker as an older version applied ``text``: its quorum queue's parking classic."""
    plan = plan_of(text)
    parking = next(q for q in plan.queues if q.role == "parking")
    old = dataclasses.replace(parking, arguments={"x-queue-type": "classic"})
    return live_of(plan, queues=[live_queue(old, messages=7)])


def test_a_classic_parking_queue_left_by_an_upgrade_is_a_migrate_that_does_not_block() -> None:
    changes = diff(plan_of(QUORUM_ONLY), _with_classic_parking())
    (moving,) = [c for c in changes if c.kind == "migrate"]
    assert moving.name == "orders.parking" and "7 messages" in moving.detail
    assert deferred(moving) and not blocking(moving)
    assert refusal(changes, "/", "t.yml") == []
    assert nothing_to_do(changes)
    (note,) = deferred_notes(changes, "t.yml")
    assert note.startswith("note: orders.parking is left as it is (")
    assert "`rabbit-retry migrate t.yml` rebuilds it" in note


def test_a_main_queue_that_must_be_rebuilt_still_blocks_apply() -> None:
    plan = plan_of(QUORUM_ONLY)
    main = next(q for q in plan.queues if q.role == "main")
    old = dataclasses.replace(main, arguments={"x-queue-type": "classic"})
    changes = diff(plan, live_of(plan, queues=[live_queue(old)]))
    (moving,) = [c for c in changes if c.kind == "migrate"]
    assert moving.name == "orders" and blocking(moving) and not deferred(moving)
    assert refusal(changes, "/", "t.yml") and not nothing_to_do(changes)


def test_one_node_queues_are_named_on_a_cluster_only() -> None:
    classic = "version: 1\nqueues:\n  a: {queue_type: classic, retry: {delays: [5s]}}\n  b: {}\n"
    plan = plan_of(classic)
    on_one = dataclasses.replace(live_of(plan), nodes=("r1@h",))
    assert single_node_notes(plan, on_one) == []
    assert single_node_notes(plan, live_of(plan)) == []  # nodes unknown: nothing to say
    on_three = dataclasses.replace(live_of(plan), nodes=NODES)
    (note,) = single_node_notes(plan, on_three)
    assert note.startswith("3 queues of a (a, a.retry.5s, a.parking) live on one node of this "
                           "3-node cluster")


def test_a_quorum_queue_with_one_member_and_an_upgraded_classic_parking_are_named() -> None:
    plan = plan_of(QUORUM_ONLY)
    live = dataclasses.replace(_with_classic_parking(), nodes=NODES)
    (note,) = single_node_notes(plan, live)
    assert "(orders.parking) lives on one node" in note
    main = next(q for q in plan.queues if q.role == "main")
    alone = live_queue(main, members=("r2@h",), online=("r2@h",))
    live = dataclasses.replace(live_of(plan, queues=[alone]), nodes=NODES)
    (note,) = single_node_notes(plan, live)
    assert "1 queue of orders (orders) lives on one node" in note
    replicated = live_queue(main, members=NODES, online=NODES)
    live = dataclasses.replace(live_of(plan, queues=[replicated]), nodes=NODES)
    assert single_node_notes(plan, live) == []


def test_a_file_asking_one_replica_is_named_before_the_queue_exists() -> None:
    plan = plan_of("version: 1\nqueues:\n  orders: {replicas: 1}\n")
    live = dataclasses.replace(LiveState.empty(), nodes=NODES)
    (note,) = single_node_notes(plan, live)
    assert "of orders (orders, orders.retry.5s, orders.retry.30s, orders.retry.5m" in note


def test_classic_queues_mirrored_by_an_ha_policy_are_not_named() -> None:
    plan = plan_of("version: 1\nqueues:\n  a: {queue_type: classic, retry: {delays: [5s]}}\n")
    ha = LivePolicy("ha-all", ".*", "queues", {"ha-mode": "all"}, 0)
    live = dataclasses.replace(live_of(plan), nodes=NODES, policies=(ha,))
    assert single_node_notes(plan, live) == []
    # A policy of higher priority without ha-mode is the one the broker applies.
    other = LivePolicy("limits", "^a$", "queues", {"max-length": 5}, 5)
    live = dataclasses.replace(live, policies=(ha, other))
    (note,) = single_node_notes(plan, live)
    assert "1 queue of a (a) lives on one node" in note


def test_a_parking_queue_with_a_limit_set_by_hand_still_blocks_apply() -> None:
    plan = plan_of(QUORUM_ONLY)
    parking = next(q for q in plan.queues if q.role == "parking")
    limited = dataclasses.replace(
        parking, arguments={"x-queue-type": "classic", "x-max-length": 1,
                            "x-overflow": "reject-publish"})
    changes = diff(plan, live_of(plan, queues=[live_queue(limited, messages=1)]))
    (moving,) = [c for c in changes if c.kind == "migrate"]
    assert moving.name == "orders.parking" and blocking(moving) and not deferred(moving)
    assert refusal(changes, "/", "t.yml")
