"""Migration steps, decided without a broker (rabbit_retry/broker/migrate_plan.py)."""

from __future__ import annotations

import dataclasses

import pytest

from rabbit_retry.broker.diff import capacity_problem, diff
from rabbit_retry.broker.inspect import (
    LiveExchange,
    LivePolicy,
    LiveQueue,
    LiveState,
    NodeCapacity,
)
from rabbit_retry.broker.migrate_plan import (
    STEPS,
    Copies,
    Seen,
    describe,
    hold_hazards,
    hold_queue,
    identity,
    is_marker,
    moved_headers,
    new_quorum_queues,
    plan_migrations,
    schedule,
    stage,
)
from rabbit_retry.errors import InputError
from rabbit_retry.topology import compile_topology, parse_topology
from rabbit_retry.topology.plan import Binding, Plan, Queue

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
queues:
  orders:
    bindings: [{exchange: shop, routing_key: "order.*"}, {exchange: later, routing_key: x}]
    retry: {delays: [5s]}
"""


def _plan() -> Plan:
    return compile_topology(parse_topology(TOPOLOGY.replace(
        "exchanges:\n", "exchanges:\n  later: {type: direct}\n"), "t.yml"))


def _live(plan: Plan, *, main: dict[str, object] | None = None, held: int | None = None,
          held_bound: bool = False, exchanges: tuple[str, ...] = ("shop",)) -> LiveState:
    queues = {}
    for q in plan.queues:
        live = LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments), messages=3)
        if q.name == "orders" and main is not None:
            live = dataclasses.replace(live, **main)  # type: ignore[arg-type]
        queues[q.name] = live
    bindings = list(plan.bindings)
    if held is not None:
        queues["orders.migrating"] = LiveQueue("orders.migrating", "classic", True, False, {},
                                               messages=held)
        if held_bound:
            bindings.append(Binding("shop", "orders.migrating", "order.*"))
    live_exchanges = {
        e.name: LiveExchange(e.name, e.type, True, False, False)
        for e in plan.exchanges if e.name in exchanges or e.name.endswith(".retry")
    }
    return LiveState(queues=queues, exchanges=live_exchanges, bindings=tuple(bindings))


@pytest.mark.parametrize(("seen", "steps"), [
    (Seen("q", exists=True, matches=True, hold_exists=False, hold_bound=False), ()),
    (Seen("q", exists=False, matches=False, hold_exists=False, hold_bound=False), ()),
    (Seen("q", exists=True, matches=False, hold_exists=False, hold_bound=False), STEPS),
    # killed after declaring the holding queue, or while routing to it, or draining:
    # route again (idempotent) and go on
    (Seen("q", exists=True, matches=False, hold_exists=True, hold_bound=True), STEPS[1:]),
    (Seen("q", exists=True, matches=False, hold_exists=True, hold_bound=False), STEPS[1:]),
    # killed between deleting and declaring the queue
    (Seen("q", exists=False, matches=False, hold_exists=True, hold_bound=True),
     ("redeclare", "route-back", "refill")),
    # killed after declaring it again, before the holding queue was unbound
    (Seen("q", exists=True, matches=True, hold_exists=True, hold_bound=True),
     ("route-back", "refill")),
    # killed while refilling
    (Seen("q", exists=True, matches=True, hold_exists=True, hold_bound=False), ("refill",)),
])
def test_the_step_to_resume_at_is_read_from_what_exists(
    seen: Seen, steps: tuple[str, ...]
) -> None:
    assert stage(seen) == steps


def test_a_changed_type_plans_every_step_with_the_file_bindings_that_can_be_made() -> None:
    plan = _plan()
    live = _live(plan, main={"type": "classic", "messages": 40})
    migrations = plan_migrations(diff(plan, live), live, plan.bindings)
    assert [m.name for m in migrations] == ["orders"]
    (migration,) = migrations
    assert migration.steps == STEPS
    assert migration.messages == 40
    assert migration.differences[0] == "type: live classic, file quorum"
    # the binding from an exchange the broker lacks is left to apply
    assert [(b.source, b.routing_key) for b in migration.bindings] == [("shop", "order.*")]
    lines = describe(migration)
    assert lines[0].startswith("queue orders: type: live classic, file quorum")
    assert lines[0].endswith("(40 messages, all kept)")
    assert [line.split()[0] for line in lines[1:]] == list(STEPS)


def test_a_migration_under_way_is_planned_even_once_the_queue_matches() -> None:
    plan = _plan()
    live = _live(plan, held=12)
    (migration,) = plan_migrations(diff(plan, live), live, plan.bindings)
    assert migration.steps == ("refill",)
    assert migration.messages == 15
    assert describe(migration)[0] == (
        "queue orders: a migration was interrupted; resuming (15 messages, all kept)"
    )
    change = next(c for c in diff(plan, live) if c.name == "orders" and c.object == "queue")
    assert (change.kind, change.detail) == (
        "migrate", "a migration is under way; migrate keeps its 15 messages"
    )


def test_nothing_to_migrate_when_the_broker_matches() -> None:
    plan = _plan()
    live = _live(plan)
    assert plan_migrations(diff(plan, live), live, plan.bindings) == []


def test_tiers_and_parking_queues_migrate_like_main_queues() -> None:
    plan = _plan()
    tier = next(q for q in plan.queues if q.role == "tier")
    live = _live(plan)
    queues = dict(live.queues)
    queues[tier.name] = dataclasses.replace(
        queues[tier.name], arguments={**tier.arguments, "x-message-ttl": 1000}
    )
    live = dataclasses.replace(live, queues=queues)
    (migration,) = plan_migrations(diff(plan, live), live, plan.bindings)
    assert migration.name == tier.name
    assert isinstance(migration.queue, Queue) and migration.queue.delay_ms == 5000
    assert {b.source for b in migration.bindings} == {"orders.retry"}
    assert hold_queue(tier.name) == "orders.retry.5s.migrating"


def test_copies_are_recognised_by_id_and_body_once_per_time_they_are_held() -> None:
    a, b = identity("m-1", b"x"), identity("m-2", b"x")
    copies = Copies([a, a, b, None])
    assert len(copies) == 3
    assert copies.take(identity("m-1", b"x")) and copies.take(a)
    assert not copies.take(a)  # both held copies used up: the next one is a message
    assert not copies.take(identity("m-2", b"y"))  # same id, another body: not a copy
    assert copies.take(b)


def test_a_message_without_an_id_is_never_taken_for_a_copy() -> None:
    assert identity(None, b"x") is None and identity("", b"x") is None
    assert not Copies([None]).take(None)


def test_moved_copies_lose_the_brokers_delivery_counts_only() -> None:
    headers = {"x-delivery-count": 3, "x-acquired-count": 4, "retry-count": 1, "x-death": []}
    assert moved_headers(headers) == {"retry-count": 1, "x-death": []}
    assert moved_headers(None) == {}


def test_the_marker_is_recognised_as_text_or_bytes() -> None:
    assert is_marker({"x-rabbit-retry-migration": "routed-back"})
    assert is_marker({"x-rabbit-retry-migration": b"routed-back"})
    assert not is_marker({"x-rabbit-retry-migration": "other"})
    assert not is_marker(None)


def test_a_policy_that_would_drop_held_messages_is_named_before_anything_starts() -> None:
    plan = _plan()
    live = _live(plan, main={"type": "classic"})
    migrations = plan_migrations(diff(plan, live), live, plan.bindings)
    policies = [
        LivePolicy("all-short", ".*", "all", {"message-ttl": 1000}, 1),
        LivePolicy("exact", "^orders$", "queues", {"max-length": 1}, 1),  # not the holding queue
        LivePolicy("harmless", ".*", "queues", {"queue-mode": "lazy"}, 1),
        LivePolicy("cap", "migrating$", "queues", {"max-length": 5}, 0, operator=True),
    ]
    assert hold_hazards(migrations, policies) == [
        "policy all-short (message-ttl) would apply to the holding queue orders.migrating and "
        "could drop messages while they wait there; narrow its pattern first",
        "operator policy cap (max-length) would apply to the holding queue orders.migrating and "
        "could drop messages while they wait there; narrow its pattern first",
    ]
    resumed = [dataclasses.replace(m, steps=m.steps[1:]) for m in migrations]
    assert hold_hazards(resumed, policies) == []


def test_a_queue_named_like_a_holding_queue_is_refused() -> None:
    text = "version: 1\nqueues:\n  orders: {}\n  orders.parking.migrating: {}\n"
    with pytest.raises(InputError) as caught:
        parse_topology(text, "t.yml")
    assert str(caught.value) == (
        "t.yml:4: queues.orders.parking.migrating: queue 'orders.parking.migrating' collides "
        "with the holding queue `rabbit-retry migrate` uses for queue 'orders.parking'"
    )
    parse_topology("version: 1\nqueues:\n  other.migrating: {}\n", "t.yml")  # no such queue


def test_tiers_are_held_before_their_main_queue_is_rebuilt_and_refilled_after() -> None:
    plan = _plan()
    live = _live(plan, main={"type": "classic"})
    queues = dict(live.queues)
    for q in plan.queues:
        if q.role == "tier":
            queues[q.name] = dataclasses.replace(queues[q.name], type="classic")
    live = dataclasses.replace(live, queues=queues)
    migrations = plan_migrations(diff(plan, live), live, plan.bindings)
    assert [m.name for m in migrations] == ["orders", "orders.retry.5s"]
    order = [(m.name, steps) for m, steps in schedule(migrations)]
    assert order == [
        ("orders.retry.5s", ("hold", "route-to-hold", "drain")),
        ("orders", STEPS),
        ("orders.retry.5s", ("release", "redeclare", "route-back", "refill")),
    ]
    # Alone (its main queue needs nothing, or is done), a tier runs every step at once.
    (tier,) = [m for m in migrations if m.queue.role == "tier"]
    assert schedule([tier]) == [(tier, STEPS)]


def test_the_window_of_a_move_shrinks_for_large_messages() -> None:
    from rabbit_retry.broker.migrate import BYTES_IN_FLIGHT, WINDOW, window_for

    assert window_for(0) == window_for(200) == WINDOW
    assert window_for(1024 * 1024) == BYTES_IN_FLIGHT // (1024 * 1024) == 64
    assert window_for(16 * 1024 * 1024) == 4
    assert window_for(10 * BYTES_IN_FLIGHT) == 1


def test_the_quorum_queues_a_migration_adds_are_counted_for_the_open_file_guard() -> None:
    plan = _plan()
    live = _live(plan, main={"type": "classic", "arguments": {"x-queue-type": "classic"}})
    migrations = plan_migrations(diff(plan, live), live, plan.bindings)
    assert [m.name for m in migrations] == ["orders"]
    assert new_quorum_queues(migrations, live) == 1  # classic -> quorum: one more
    # Resumed after the classic queue was deleted: still one more than the broker holds.
    (migration,) = migrations
    resumed = dataclasses.replace(migration, steps=("redeclare", "route-back", "refill"))
    gone = dataclasses.replace(live, queues={k: v for k, v in live.queues.items()
                                             if k != "orders"})
    assert new_quorum_queues([resumed], gone) == 1
    # A quorum queue rebuilt as quorum (another argument changed) adds none; nor does a
    # migration past its redeclare step.
    quorum = _live(plan, main={"arguments": {"x-queue-type": "quorum", "x-max-length": 5}})
    rebuilt = plan_migrations(diff(plan, quorum), quorum, plan.bindings)
    assert [m.name for m in rebuilt] == ["orders"] and new_quorum_queues(rebuilt, quorum) == 0
    refilling = dataclasses.replace(migration, steps=("refill",))
    assert new_quorum_queues([refilling], live) == 0
    # What migrate then asks: the same guard as apply's, with this count.
    capacity = NodeCapacity(version="3.10.8", fd_total=1024, quorum_queues=260)
    assert capacity_problem(capacity, new_quorum_queues(migrations, live)) is not None
    assert capacity_problem(capacity, 0) is None
