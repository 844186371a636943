"""``status`` without a broker: counts per main queue, old tiers included, and drift first
where it drops messages."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console, RenderableType

from rabbit_retry.broker.diff import diff
from rabbit_retry.broker.inspect import LiveExchange, LivePolicy, LiveQueue, LiveState
from rabbit_retry.status import build_status, status_view
from rabbit_retry.tables import cell
from rabbit_retry.topology import Plan, compile_topology, parse_topology

TOPOLOGY = """
version: 1
exchanges: {orders: {type: topic}}
queues:
  orders:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [1s, 1m], max_attempts: 3}
  payments:
    queue_type: classic
"""


def plan_of() -> Plan:
    return compile_topology(parse_topology(TOPOLOGY, "t.yml"))


def live_of(plan: Plan, *, counts: dict[str, tuple[int, int, int]] | None = None,
            drop: tuple[str, ...] = (), extra: tuple[LiveQueue, ...] = ()) -> LiveState:
    """The live state a successful apply leaves, with ``counts`` (ready, unacked, consumers)."""
    counts = counts or {}
    queues = {}
    for q in plan.queues:
        if q.name in drop:
            continue
        ready, unacked, consumers = counts.get(q.name, (0, 0, 0))
        queues[q.name] = LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                                   ready + unacked, ready, unacked, consumers)
    for q in extra:
        queues[q.name] = q
    exchanges = {e.name: LiveExchange(e.name, e.type, e.durable, e.auto_delete, e.internal,
                                      dict(e.arguments))
                 for e in plan.exchanges if e.name not in drop}
    bindings = tuple(b for b in plan.bindings
                     if b.destination not in drop and b.source not in drop)
    return LiveState(queues, exchanges, bindings)


def test_counts_per_main_queue_with_old_tiers_still_draining() -> None:
    plan = plan_of()
    old_tier = LiveQueue("orders.retry.5m", "classic", True, False,
                         {"x-message-ttl": 300000, "x-dead-letter-exchange": "",
                          "x-dead-letter-routing-key": "orders"}, 4, 4, 0, 0)
    live = live_of(plan, counts={"orders": (7, 2, 1), "orders.retry.1s": (3, 0, 0),
                                 "orders.retry.1m": (1, 0, 0), "orders.parking": (5, 0, 0),
                                 "payments": (9, 0, 0)},
                   extra=(old_tier,))
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    orders, payments = status.queues
    assert orders.to_json() == {
        "queue": "orders", "ready": 7, "unacked": 2, "consumers": 1, "retrying": 8,
        "parked": 5,
        "tiers": {"orders.retry.1m": 1, "orders.retry.1s": 3, "orders.retry.5m": 4},
        "held_for_dead_lettering": {}, "stranded_by_dead_letter_cycle": {}, "replicas": [],
        "policy": {"name": None, "priority": None, "definition": {}, "tied": [],
                   "operator_policy": None, "operator_definition": {}, "ours": None,
                   "ours_applies": False},
    }
    assert (payments.queue, payments.ready, payments.retrying) == ("payments", 9, 0)
    assert status.ok and status.drift == ()  # an old tier draining is not drift


def test_a_missing_tier_or_parking_queue_comes_first_and_says_messages_are_dropped() -> None:
    plan = plan_of()
    live = live_of(plan, drop=("orders", "orders.retry.1m", "orders.parking"))
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    assert not status.ok
    lines = [d.line for d in status.drift]
    assert lines[:2] == [
        "missing queue orders.retry.1m (retry tier of orders): the broker drops the messages "
        "that should go there",
        "missing queue orders.parking (parking queue of orders): the broker drops the messages "
        "that should go there",
    ]
    assert "missing binding orders.retry -> orders.retry.1m [1m] (retry route of orders): the "\
        "broker drops the messages that should go there" in lines
    # the main queue is missing too: reported, after what silently drops retries
    assert lines[-2:] == ["missing queue orders",
                          "missing binding orders -> orders [order.*]"]
    orders = status.queues[0]
    assert (orders.ready, orders.unacked, orders.consumers, orders.parked) == (None,) * 4


def test_a_different_queue_is_drift_with_the_difference() -> None:
    plan = plan_of()
    live = live_of(plan)
    parking = live.queues["orders.parking"]
    queues = {**live.queues, "orders.parking": LiveQueue(
        parking.name, "quorum", True, False, {"x-queue-type": "quorum"})}
    live = LiveState(queues, live.exchanges, live.bindings)
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    (drift,) = status.drift
    assert drift.to_json() == {
        "kind": "different", "object": "queue", "name": "orders.parking", "owner": "orders",
        "role": "parking", "detail": "type: live quorum, file classic; migrate keeps its 0 "
        "messages", "drops_messages": False,
    }
    assert drift.line == ("different queue orders.parking (parking queue of orders): type: live "
                          "quorum, file classic; migrate keeps its 0 messages")


def test_messages_a_quorum_queue_holds_for_dead_lettering_are_reported_per_queue() -> None:
    plan = plan_of()
    live = live_of(plan)
    stuck = {"orders": 2, "orders.retry.1s": 3, "payments": 0}
    queues = {name: LiveQueue(q.name, "quorum", q.durable, q.auto_delete, q.arguments,
                              q.messages, q.messages_ready, q.messages_unacknowledged,
                              q.consumers, messages_dlx=stuck.get(name, 0))
              for name, q in live.queues.items()}
    live = LiveState(queues, live.exchanges, live.bindings)
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    orders, payments = status.queues
    assert orders.to_json()["held_for_dead_lettering"] == {"orders": 2, "orders.retry.1s": 3}
    assert payments.held == ()
    # Every object of the retry path is there: the broker's cycle check holds them.
    assert orders.to_json()["stranded_by_dead_letter_cycle"] == {"orders": 2,
                                                                 "orders.retry.1s": 3}
    lines = " ".join(" ".join(printed(status_view(status))).split())
    assert ("orders.retry.1s: 3 messages stranded by RabbitMQ's dead-letter cycle check: they "
            "reached orders's delivery limit") in lines
    assert "no command can move them out" in lines and "purging or deleting" in lines
    # A missing tier is what holds them instead: apply recreates it and they move on.
    without_tier = LiveState({n: q for n, q in live.queues.items() if n != "orders.retry.1s"},
                             live.exchanges, live.bindings)
    status = build_status(plan, without_tier, diff(plan, without_tier), vhost="v",
                          source="t.yml")
    orders = status.queues[0]
    assert orders.to_json()["stranded_by_dead_letter_cycle"] == {}
    assert ("orders: 2 messages held by the broker for dead-lettering: the queue they go to next "
            "is missing; `rabbit-retry apply t.yml` recreates it") in " ".join(
                " ".join(printed(status_view(status))).split())


def printed(renderable: RenderableType) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return [line.rstrip() for line in out.getvalue().splitlines()]


def test_the_status_view_puts_drift_before_the_counts() -> None:
    plan = plan_of()
    live = live_of(plan, drop=("orders.parking",), counts={"orders": (7, 2, 1)})
    lines = printed(status_view(build_status(plan, live, diff(plan, live), vhost="v",
                                             source="t.yml")))
    assert lines[0] == ("DRIFT: 1 object of t.yml missing or different on the broker; "
                        "`rabbit-retry plan t.yml` shows the fix")
    assert lines[1].startswith("  missing queue orders.parking (parking queue of orders)")
    assert lines[3].strip() == "vhost v"
    orders = next(line.replace("│", " ").split() for line in lines if line.startswith("orders"))
    assert orders == ["orders", "7", "2", "1", "0", "-"]  # no parking queue: a dash


def test_the_status_view_says_no_drift() -> None:
    plan = plan_of()
    live = live_of(plan)
    lines = printed(status_view(build_status(plan, live, (), vhost="v", source="t.yml")))
    assert lines[-1] == "no drift: the broker has every object t.yml derives"


def test_the_status_view_shows_the_policy_that_applies_and_warns_when_ours_loses() -> None:
    plan = compile_topology(parse_topology(TOPOLOGY.replace(
        "  payments:\n", "  payments:\n    policy: {max_length: 100}\n    on_full: park\n"),
        "t.yml"))
    ours = LivePolicy("rabbit-retry:payments", "^payments$", "queues", {"max-length": 100}, 10)
    greedy = LivePolicy("greedy", "^pay", "queues", {"max-length": 1}, 50)
    cap = LivePolicy("cap", ".*", "queues", {"max-length": 10}, 0, operator=True)
    base = live_of(plan)

    live = replace(base, policies=(ours, cap))
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    assert status.warnings == () and status.drift == ()
    # The operator policy's limit of 10 reaches every queue (on payments it is lower than the
    # file's 100, so it applies there too): a problem (tests/unit/test_policy_hazards.py).
    assert not status.ok and "payments.parking" in {h.queue for h in status.policy_hazards}
    lines = printed(status_view(status))
    rows = {line.split("│")[0].strip(): [c.strip() for c in line.split("│")[1:]]
            for line in lines if "│" in line and line.split("│")[0].strip() in ("orders",
                                                                                 "payments")
            and len(line.split("│")) == 4}
    assert rows == {
        "orders": ["-", "cap (merged: lower limits win)", "-"],
        "payments": ["rabbit-retry:payments (priority 10; max-length: 100)",
                     "cap (merged: lower limits win)", "rabbit-retry:payments: applies"],
    }
    assert status.queues[1].to_json()["policy"]["ours_applies"] is True

    live = replace(base, policies=(ours, greedy))
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    warning = ("payments: policy greedy (priority 50) wins over rabbit-retry:payments (priority "
               "10): the file's tunables do not apply")
    assert status.warnings == (warning,)
    assert status.to_json()["warnings"] == [warning]
    lines = printed(status_view(status))
    assert f"WARNING: {warning}" in lines
    assert any("rabbit-retry:payments: does not apply" in line for line in lines)


def test_without_any_policy_the_status_view_has_no_policy_table() -> None:
    plan = plan_of()
    live = live_of(plan)
    lines = printed(status_view(build_status(plan, live, (), vhost="v", source="t.yml")))
    assert not any("policies" in line for line in lines)


def test_an_empty_cell_is_a_dash_and_never_markup() -> None:
    assert [cell(v).plain for v in (None, "", 0, "[bold]x")] == ["-", "-", "0", "[bold]x"]
