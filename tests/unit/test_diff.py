"""The plan-vs-live diff, without a broker: every change kind and the detail a user reads."""

from __future__ import annotations

import dataclasses
from typing import Any

from rabbit_retry.broker.declare import unsendable
from rabbit_retry.broker.diff import (
    Change,
    apply_work,
    capacity_problem,
    count,
    diff,
    new_quorum_queues,
    nothing_to_do,
)
from rabbit_retry.broker.inspect import LiveExchange, LiveQueue, LiveState, NodeCapacity
from rabbit_retry.topology import Plan, compile_topology, parse_topology
from rabbit_retry.topology.plan import Binding, Exchange, Queue

TOPOLOGY = """
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.fraud-check:
    bindings: [{exchange: orders, routing_key: order.created}]
    retry: {delays: [5s, 30s], max_attempts: 3}
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [10s], max_attempts: 3}
    arguments: {x-max-length: 100000}
    on_full: park
"""


def plan_of(text: str = TOPOLOGY) -> Plan:
    return compile_topology(parse_topology(text, "t.yml"))


def live_queue(queue: Queue, *, messages: int = 0, **changes: Any) -> LiveQueue:
    # As the management API reports it: the type as a field, arguments as declared.
    live = LiveQueue(
        name=queue.name,
        type=queue.queue_type,
        durable=True,
        auto_delete=False,
        arguments=dict(queue.arguments),
        messages=messages,
        messages_ready=messages,
    )
    return dataclasses.replace(live, **changes)


def live_exchange(exchange: Exchange, **changes: Any) -> LiveExchange:
    live = LiveExchange(
        exchange.name, exchange.type, exchange.durable, exchange.auto_delete,
        exchange.internal, dict(exchange.arguments),
    )
    return dataclasses.replace(live, **changes)


def live_of(
    plan: Plan,
    *,
    queues: list[LiveQueue] | None = None,
    bindings: list[Binding] | None = None,
) -> LiveState:
    """The broker as if ``plan`` had been applied, then ``queues`` declared on top."""
    live_queues = {q.name: live_queue(q) for q in plan.queues}
    for q in queues or []:
        live_queues[q.name] = q
    return LiveState(
        queues=live_queues,
        exchanges={e.name: live_exchange(e) for e in plan.exchanges},
        bindings=tuple(plan.bindings) + tuple(bindings or []),
    )


def by_name(changes: list[Change], name: str) -> Change:
    [change] = [c for c in changes if c.name == name]
    return change


def not_unchanged(changes: list[Change]) -> list[tuple[str, str, str]]:
    return [(c.kind, c.object, c.name) for c in changes if c.kind != "unchanged"]


def test_empty_broker_creates_every_object_in_declaration_order() -> None:
    plan = plan_of()
    changes = diff(plan, LiveState.empty())
    assert [(c.kind, c.object, c.name) for c in changes] == [
        ("create", "exchange", "orders"),
        ("create", "exchange", "orders.fraud-check.retry"),
        ("create", "exchange", "orders.email.retry"),
        ("create", "queue", "orders.fraud-check"),
        ("create", "queue", "orders.fraud-check.retry.5s"),
        ("create", "queue", "orders.fraud-check.retry.30s"),
        ("create", "queue", "orders.fraud-check.parking"),
        ("create", "queue", "orders.email"),
        ("create", "queue", "orders.email.retry.10s"),
        ("create", "queue", "orders.email.parking"),
        ("create", "binding", "orders -> orders.fraud-check [order.created]"),
        ("create", "binding", "orders.fraud-check.retry -> orders.fraud-check.retry.5s [5s]"),
        (
            "create",
            "binding",
            "orders.fraud-check.retry -> orders.fraud-check.retry.5s [orders.fraud-check]",
        ),
        ("create", "binding", "orders.fraud-check.retry -> orders.fraud-check.retry.30s [30s]"),
        ("create", "binding", "orders -> orders.email [order.*]"),
        ("create", "binding", "orders.email.retry -> orders.email.retry.10s [10s]"),
        ("create", "binding", "orders.email.retry -> orders.email.parking [orders.email]"),
    ]
    assert by_name(changes, "orders.fraud-check.retry.30s").detail == "quorum, tier, ttl 30s"
    assert by_name(changes, "orders.email").detail == "classic, main"
    assert by_name(changes, "orders").detail == "topic"
    assert all(c.item is not None for c in changes)
    assert not nothing_to_do(changes)


def test_applied_plan_is_all_unchanged() -> None:
    plan = plan_of()
    changes = diff(plan, live_of(plan))
    assert {c.kind for c in changes} == {"unchanged"}
    assert len(changes) == len(plan.exchanges) + len(plan.queues) + len(plan.bindings)
    assert nothing_to_do(changes) and nothing_to_do(changes, prune=True)
    assert count(changes) == {
        "create": 0, "unchanged": 17, "update": 0, "conflict": 0, "migrate": 0, "unbind": 0,
        "prune": 0, "keep": 0, "grow": 0,
    }


def test_classic_queue_declared_without_type_argument_is_unchanged() -> None:
    plan = plan_of()
    email = next(q for q in plan.queues if q.name == "orders.email")
    args = {k: v for k, v in email.arguments.items() if k != "x-queue-type"}
    changes = diff(plan, live_of(plan, queues=[live_queue(email, arguments=args)]))
    assert by_name(changes, "orders.email").kind == "unchanged"


def test_queue_of_the_wrong_type_is_a_migration_naming_the_type() -> None:
    plan = plan_of()
    main = next(q for q in plan.queues if q.name == "orders.fraud-check")
    changes = diff(plan, live_of(plan, queues=[live_queue(main, type="classic")]))
    change = by_name(changes, "orders.fraud-check")
    assert (change.kind, change.object) == ("migrate", "queue")
    assert change.detail == "type: live classic, file quorum; migrate keeps its 0 messages"
    assert change.item == main
    assert not nothing_to_do(changes, prune=True)


def test_different_ttl_on_a_tier_is_a_migration_with_both_values() -> None:
    plan = plan_of()
    tier = next(q for q in plan.queues if q.name == "orders.fraud-check.retry.5s")
    args = {**tier.arguments, "x-message-ttl": 3000}
    changes = diff(plan, live_of(plan, queues=[live_queue(tier, arguments=args)]))
    assert by_name(changes, tier.name).detail == (
        "x-message-ttl: live 3000, file 5000; migrate keeps its 0 messages"
    )
    assert not_unchanged(changes) == [("migrate", "queue", tier.name)]


def test_missing_extra_and_boolean_arguments_are_migrations() -> None:
    plan = plan_of()
    email = next(q for q in plan.queues if q.name == "orders.email")
    args = {
        **{k: v for k, v in email.arguments.items() if k != "x-max-length"},
        "x-single-active-consumer": True,
        "x-dead-letter-routing-key": "",
    }
    live = live_queue(email, arguments=args, durable=False, auto_delete=True)
    change = by_name(diff(plan, live_of(plan, queues=[live])), "orders.email")
    assert change.kind == "migrate"
    assert change.detail == (
        "durable: live false, file true; auto_delete: live true, file false; "
        'x-dead-letter-routing-key: live "", file orders.email; '
        "x-max-length: live absent, file 100000; "
        "x-single-active-consumer: live true, file absent; migrate keeps its 0 messages"
    )


def test_boolean_is_not_equal_to_one() -> None:
    plan = plan_of(TOPOLOGY.replace("x-max-length: 100000", "x-max-length: 1"))
    email = next(q for q in plan.queues if q.name == "orders.email")
    live = live_queue(email, arguments={**email.arguments, "x-max-length": True})
    change = by_name(diff(plan, live_of(plan, queues=[live])), "orders.email")
    assert change.detail == "x-max-length: live true, file 1; migrate keeps its 0 messages"


def test_exchange_conflicts_name_every_field() -> None:
    plan = plan_of()
    orders = plan.exchanges[0]
    live = live_of(plan)
    exchanges = dict(live.exchanges)
    exchanges["orders"] = live_exchange(
        orders, type="direct", durable=False, auto_delete=True, internal=True,
        arguments={"alternate-exchange": "ae"},
    )
    changes = diff(plan, dataclasses.replace(live, exchanges=exchanges))
    change = by_name(changes, "orders")
    assert (change.kind, change.object) == ("conflict", "exchange")
    assert change.detail == (
        "type: live direct, file topic; durable: live false, file true; "
        "auto_delete: live true, file false; internal: live true, file false; "
        "alternate-exchange: live ae, file absent"
    )


def test_missing_binding_is_created_and_binding_arguments_count() -> None:
    plan = plan_of()
    wanted = plan.bindings[0]
    other_args = Binding(wanted.source, wanted.destination, wanted.routing_key, {"x-match": "all"})
    live = live_of(plan)
    live = dataclasses.replace(
        live, bindings=(*(b for b in live.bindings if b != wanted), other_args)
    )
    changes = diff(plan, live)
    assert not_unchanged(changes) == [
        ("create", "binding", "orders -> orders.fraud-check [order.created]")
    ]
    assert by_name(changes, "orders -> orders.fraud-check [order.created]").item == wanted


NEW_DELAYS = TOPOLOGY.replace("delays: [5s, 30s]", "delays: [10s, 1m]")


def test_changed_delays_create_new_tiers_and_unbind_the_old_first_tier() -> None:
    old, new = plan_of(), plan_of(NEW_DELAYS)
    changes = diff(new, live_of(old))
    assert not_unchanged(changes) == [
        ("create", "queue", "orders.fraud-check.retry.10s"),
        ("create", "queue", "orders.fraud-check.retry.1m"),
        ("create", "binding", "orders.fraud-check.retry -> orders.fraud-check.retry.10s [10s]"),
        (
            "create",
            "binding",
            "orders.fraud-check.retry -> orders.fraud-check.retry.10s [orders.fraud-check]",
        ),
        ("create", "binding", "orders.fraud-check.retry -> orders.fraud-check.retry.1m [1m]"),
        (
            "unbind",
            "binding",
            "orders.fraud-check.retry -> orders.fraud-check.retry.5s [orders.fraud-check]",
        ),
        ("prune", "queue", "orders.fraud-check.retry.30s"),
        ("prune", "queue", "orders.fraud-check.retry.5s"),
    ]
    unbind = next(c for c in changes if c.kind == "unbind")
    assert unbind.detail == (
        "orders.fraud-check.retry.5s is no longer the first tier of orders.fraud-check"
    )
    assert unbind.item == Binding(
        "orders.fraud-check.retry", "orders.fraud-check.retry.5s", "orders.fraud-check"
    )
    prune = by_name(changes, "orders.fraud-check.retry.5s")
    assert prune.detail == "obsolete, empty"
    assert isinstance(prune.item, Queue)
    assert (prune.item.owner, prune.item.delay_ms, prune.item.queue_type) == (
        "orders.fraud-check", 5000, "quorum",
    )
    # Obsolete tiers alone leave nothing to do unless pruning was asked for.
    settled = [c for c in changes if c.kind in ("unchanged", "prune")]
    assert nothing_to_do(settled) and not nothing_to_do(settled, prune=True)
    kept = [dataclasses.replace(c, kind="keep") if c.kind == "prune" else c for c in settled]
    assert nothing_to_do(kept) and not nothing_to_do(kept, prune=True)


def test_a_new_first_tier_takes_the_first_tier_key() -> None:
    old = plan_of()
    new = plan_of(TOPOLOGY.replace("delays: [5s, 30s]", "delays: [30s]"))
    changes = diff(new, live_of(old))
    assert not_unchanged(changes) == [
        (
            "create",
            "binding",
            "orders.fraud-check.retry -> orders.fraud-check.retry.30s [orders.fraud-check]",
        ),
        (
            "unbind",
            "binding",
            "orders.fraud-check.retry -> orders.fraud-check.retry.5s [orders.fraud-check]",
        ),
        ("prune", "queue", "orders.fraud-check.retry.5s"),
    ]


def test_non_empty_obsolete_tier_is_kept_with_its_count() -> None:
    old, new = plan_of(), plan_of(NEW_DELAYS)
    tier = next(q for q in old.queues if q.name == "orders.fraud-check.retry.30s")
    one = next(q for q in old.queues if q.name == "orders.fraud-check.retry.5s")
    live = live_of(old, queues=[live_queue(tier, messages=3), live_queue(one, messages=1)])
    changes = diff(new, live)
    assert by_name(changes, tier.name).kind == "keep"
    assert by_name(changes, tier.name).detail == "obsolete, 3 messages still in it"
    assert by_name(changes, one.name).detail == "obsolete, 1 message still in it"


def test_never_proposes_deleting_what_the_file_does_not_derive() -> None:
    plan = plan_of()
    main = next(q for q in plan.queues if q.name == "orders.fraud-check")
    tier = next(q for q in plan.queues if q.name == "orders.fraud-check.retry.5s")
    strangers = [
        # shaped like a tier, but not a canonical label or not wired like a tier
        live_queue(tier, name="orders.fraud-check.retry.audit"),
        live_queue(tier, name="orders.fraud-check.retry.60s"),  # canonical would be 1m
        live_queue(tier, name="orders.fraud-check.retry.2m", arguments={"x-message-ttl": 1}),
        live_queue(main, name="orders.fraud-check.retry.3m"),
        # a tier of a queue the file does not mention
        live_queue(tier, name="billing.retry.5s",
                   arguments={**tier.arguments, "x-dead-letter-routing-key": "billing"}),
        live_queue(main, name="unrelated"),
    ]
    stray_binding = Binding("orders.fraud-check.retry", "unrelated", "orders.fraud-check")
    live = live_of(plan, queues=strangers, bindings=[stray_binding])
    changes = diff(plan, live)
    # The tier of a queue the file does not mention is reported (another file's, or one that
    # left this file), never deleted by apply unless --target names its queue.
    assert not_unchanged(changes) == [("prune", "queue", "billing.retry.5s")]
    assert by_name(changes, "billing.retry.5s").orphan
    assert not_unchanged(apply_work(changes, targeted=False)) == []


def test_obsolete_tier_is_pruned_even_when_its_name_sorts_anywhere() -> None:
    plan = plan_of()
    tier = next(q for q in plan.queues if q.name == "orders.email.retry.10s")
    old_tier = live_queue(tier, name="orders.email.retry.1500ms")
    changes = diff(plan, live_of(plan, queues=[old_tier]))
    assert not_unchanged(changes) == [("prune", "queue", "orders.email.retry.1500ms")]


def test_to_json_is_stable_and_carries_binding_parts() -> None:
    changes = diff(plan_of(), LiveState.empty())
    assert changes[0].to_json() == {
        "kind": "create", "object": "exchange", "name": "orders", "detail": "topic",
        "orphan": False, "owner": None,
    }
    assert changes[-1].to_json() == {
        "kind": "create",
        "object": "binding",
        "name": "orders.email.retry -> orders.email.parking [orders.email]",
        "source": "orders.email.retry",
        "destination": "orders.email.parking",
        "routing_key": "orders.email",
        "arguments": {},
        "detail": "",
        "orphan": False,
        "owner": None,
    }


# --- what apply refuses before it touches anything --------------------------------------------


def test_capacity_problem_on_rabbitmq_3_with_a_low_file_limit() -> None:
    small = NodeCapacity(version="3.10.8", fd_total=1024, quorum_queues=56)
    # (1024 * 4 // 5 - 50) // 3 = 256 quorum queues in all
    assert capacity_problem(small, 200) is None
    assert capacity_problem(small, 201) == (
        "refusing to declare 201 quorum queues: the broker would hold 257, and RabbitMQ 3.10.8 "
        "with an open-file limit of 1024 holds about 256 before every queue declaration on the "
        "node stalls; raise the broker's open-file limit (ulimit -n, LimitNOFILE) or use "
        "classic queues for some; nothing was changed"
    )
    assert capacity_problem(small, 0) is None
    # RabbitMQ 4 reserves no file handles per quorum queue; an unknown limit is not guessed.
    assert capacity_problem(NodeCapacity("4.1.0", 1024, 5000), 1000) is None
    assert capacity_problem(NodeCapacity("3.13.7", None, 5000), 1000) is None
    assert capacity_problem(NodeCapacity("3.13.7", 1_048_576, 5000), 1000) is None


def test_new_quorum_queues_counts_only_quorum_creates() -> None:
    changes = diff(plan_of(), LiveState.empty())
    # fraud-check: main, two tiers and its parking queue; the email queue's are classic
    assert new_quorum_queues(changes) == 4
    assert new_quorum_queues(diff(plan_of(), live_of(plan_of()))) == 0


def unchecked_plan_of(text: str) -> Plan:
    """A plan from a file the loader refuses (its names): the apply-side guard still holds."""
    from ruamel.yaml import YAML

    from rabbit_retry.topology.model import TopologySpec, resolve

    return compile_topology(resolve(TopologySpec.model_validate(YAML(typ="safe").load(text))))


def test_names_amqp_clients_cannot_send_are_named_once_per_queue() -> None:
    plan = unchecked_plan_of(
        TOPOLOGY.replace("orders.email:", "orders.émail:")
        + "  " + "q" * 122 + ": {}\n"  # the queue fits, its retry exchange is 128 characters
    )
    lines = unsendable(diff(plan, LiveState.empty()))
    hint = (
        "names may hold letters, digits, - _ . : @ # , / + and spaces, exchange names at most "
        "127 characters"
    )
    assert lines == [
        f"queue 'orders.émail': AMQP clients cannot use this name (invalid value for queue); "
        f"{hint}",
        f"exchange '{'q' * 122}.retry': AMQP clients cannot use this name (max length exceeded "
        f"for exchange); {hint}",
    ]
    assert unsendable(diff(plan_of(), LiveState.empty())) == []


def test_a_rescue_queue_bound_to_the_retry_exchange_is_misrouted() -> None:
    """What an unfinished ``rabbit-retry rescue`` leaves (it lost its connection): status says
    so (drift), and apply takes the copies of every dead letter away from it."""
    plan = plan_of()
    left = Binding("orders.email.retry", "orders.email.rescue", "orders.email")
    changes = diff(plan, live_of(plan, bindings=[left]))
    assert not_unchanged(changes) == [
        ("unbind", "binding", "orders.email.retry -> orders.email.rescue [orders.email]"),
    ]
    assert by_name(changes, "orders.email.retry -> orders.email.rescue [orders.email]").detail \
        .startswith("a `rabbit-retry rescue` of orders.email that runs or did not finish")
