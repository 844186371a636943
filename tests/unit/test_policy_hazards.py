"""Other policies that drop, expire or limit the messages of the file's queues (main queues,
tiers, parking, lanes, held queues), found without a broker (rabbit_retry/broker/hazards.py),
and how status reads them."""

from __future__ import annotations

from rabbit_retry.broker.diff import diff
from rabbit_retry.broker.hazards import hazard_lines, policy_hazards
from rabbit_retry.broker.inspect import LiveExchange, LivePolicy, LiveQueue, LiveState
from rabbit_retry.status import build_status, status_view
from rabbit_retry.topology import compile_topology, parse_topology
from rabbit_retry.topology.plan import Plan

TOPOLOGY = """\
version: 1
exchanges: {shop: {type: topic}}
queues:
  orders:
    queue_type: classic
    bindings: [{exchange: shop, routing_key: "order.*"}]
    retry: {delays: [5s, 1m]}
    policy: {max_length: 1000}
    on_full: park
  points:
    bindings: [{exchange: shop, routing_key: "points"}]
    retry: {delays: [1m]}
    ordered: {key: routing_key, lanes: 2}
"""


def _plan() -> Plan:
    return compile_topology(parse_topology(TOPOLOGY, "t.yml"))


def _live(plan: Plan, *policies: LivePolicy) -> LiveState:
    """The broker with every object of ``plan`` (no drift), and ``policies``."""
    queues = {q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments))
              for q in plan.queues}
    exchanges = {e.name: LiveExchange(e.name, e.type, e.durable, e.auto_delete, e.internal,
                                      dict(e.arguments)) for e in plan.exchanges}
    ours = tuple(LivePolicy(p.name, p.pattern, p.apply_to, dict(p.definition), p.priority)
                 for p in plan.policies)
    return LiveState(queues=queues, exchanges=exchanges, bindings=plan.bindings,
                     policies=ours + policies)


def test_a_company_wide_ttl_reaches_every_queue_and_says_what_it_does_to_each_kind() -> None:
    plan = _plan()
    ttl = LivePolicy("company-ttl", ".*", "all", {"message-ttl": 3000}, 0)
    hazards = policy_hazards(plan, _live(plan, ttl))
    # Every queue but orders, whose own policy (priority 10) wins over it.
    assert {h.queue for h in hazards} == {q.name for q in plan.queues} - {"orders"}
    roles = {h.role for h in hazards}
    assert roles == {"main", "tier", "parking", "lane", "held"}
    lines = hazard_lines(hazards)
    assert ("policy company-ttl (pattern '.*', priority 0) sets message-ttl 3000 on 2 parking "
            "queues (orders.parking, points.parking): deletes parked messages 3s after they "
            "arrive") in lines
    assert ("policy company-ttl (pattern '.*', priority 0) sets message-ttl 3000 on 2 held "
            "queues (points.lane.0.held, points.lane.1.held): deletes held messages 3s after "
            "they arrive") in lines
    assert ("policy company-ttl (pattern '.*', priority 0) sets message-ttl 3000 on 3 retry "
            "tiers (orders.retry.5s, orders.retry.1m, points.retry.1m): retried messages come "
            "back after 3s, sooner than the tier's delay") in lines
    assert ("policy company-ttl (pattern '.*', priority 0) sets message-ttl 3000 on main queue "
            "points: expires messages that wait longer than 3s: they leave without a handler "
            "call, into the retry tiers, and the broker drops those that expire again (a "
            "dead-letter cycle)"
            ) in lines
    assert len(lines) == 5  # one per kind of queue (lanes too)


def test_a_longer_ttl_than_a_tiers_delay_leaves_the_tier_alone() -> None:
    plan = _plan()
    ttl = LivePolicy("slow", "retry", "queues", {"message-ttl": 120_000}, 0)
    assert policy_hazards(plan, _live(plan, ttl)) == []  # tiers of 5s and 1m: theirs apply


def test_the_highest_priority_policy_wins_and_only_its_keys_count() -> None:
    plan = _plan()
    harmless = LivePolicy("mirror", "parking$", "queues", {"ha-mode": "all"}, 5)
    limit = LivePolicy("limit", "parking$", "queues", {"max-length": 10}, 1)
    assert policy_hazards(plan, _live(plan, harmless, limit)) == []
    hazards = policy_hazards(plan, _live(plan, limit))
    assert [(h.queue, h.key, h.value) for h in hazards] == [
        ("orders.parking", "max-length", 10), ("points.parking", "max-length", 10),
    ]
    assert hazard_lines(hazards) == [
        "policy limit (pattern 'parking$', priority 1) sets max-length 10 on 2 parking queues "
        "(orders.parking, points.parking): deletes the oldest parked messages beyond 10 messages"
    ]


def test_the_files_own_policy_is_no_hazard_but_an_operator_policy_below_it_is() -> None:
    plan = _plan()
    cap = LivePolicy("cap", "^orders$", "queues", {"max-length": 5000}, 0, operator=True)
    assert policy_hazards(plan, _live(plan, cap)) == []  # the file's 1000 is lower: it applies
    cap = LivePolicy("cap", "^orders$", "queues", {"max-length": 50}, 0, operator=True)
    [hazard] = policy_hazards(plan, _live(plan, cap))
    assert (hazard.queue, hazard.key, hazard.value) == ("orders", "max-length", 50)
    assert hazard_lines([hazard]) == [
        "operator policy cap (pattern '^orders$', priority 0) sets max-length 50 on main queue "
        "orders: beyond 50 messages, dead-letters the oldest without a handler call, into the "
        "retry tiers, and the broker drops those that overflow again (a dead-letter cycle)"
    ]


def test_expiry_limits_and_delivery_limits_by_queue_type_and_apply_to() -> None:
    plan = _plan()
    expires = LivePolicy("gc", r"\.retry\.", "queues", {"expires": 60_000}, 0)
    lines = hazard_lines(policy_hazards(plan, _live(plan, expires)))
    assert lines == [
        "policy gc (pattern '\\.retry\\.', priority 0) sets expires 60000 on 3 retry tiers "
        "(orders.retry.5s, orders.retry.1m, points.retry.1m): deletes the queue and every "
        "message in it after 1m unused (a tier never has a consumer)"
    ]
    # Quorum only: points (quorum) and its lanes; its held and parking queues (quorum like
    # points) keep the parking limit, and a lower one deletes; classic orders has no delivery
    # limit; a tier is never consumed.
    limit = LivePolicy("dl", "^points", "quorum_queues", {"delivery-limit": 3}, 0)
    by_role = {h.role: h for h in policy_hazards(plan, _live(plan, limit))}
    assert set(by_role) == {"main", "lane", "held", "parking"}
    assert "a limit the worker does not know" in by_role["main"].effect
    assert by_role["held"].effect.startswith("deletes a held message returned 3 times")
    # Quorum queues reject publishes over a length limit rather than drop.
    length = LivePolicy("len", "^points$", "queues", {"max-length-bytes": 1024}, 0)
    [hazard] = policy_hazards(plan, _live(plan, length))
    assert hazard.effect == "refuses messages beyond 1024 bytes (reject-publish)"
    # Policies for exchanges only, or for the other queue type, reach none of them.
    others = (LivePolicy("x", ".*", "exchanges", {"message-ttl": 1}, 9),
              LivePolicy("c", "^points$|lane", "classic_queues", {"message-ttl": 1}, 9),
              LivePolicy("s", ".*", "streams", {"max-length": 1}, 9))
    assert policy_hazards(plan, _live(plan, *others)) == []


def test_status_reports_a_hazard_as_a_problem_not_as_no_drift() -> None:
    plan = _plan()
    clean = _live(plan)
    status = build_status(plan, clean, diff(plan, clean), vhost="v", source="t.yml")
    assert status.ok and status.policy_hazards == ()  # positive control: nothing applies
    ttl = LivePolicy("company-ttl", ".*", "all", {"message-ttl": 3000}, 0)
    live = _live(plan, ttl)
    status = build_status(plan, live, diff(plan, live), vhost="v", source="t.yml")
    assert status.drift == () and not status.ok
    data = status.to_json()
    assert data["ok"] is False and len(data["policy_hazard_lines"]) == 5
    assert {h["queue"] for h in data["policy_hazards"]} >= {"orders.parking", "points.parking"}
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(status_view(status))
    text = console.export_text()
    assert "no drift" not in text
    assert "POLICIES: other policies on the broker drop, expire or limit the messages of" in text
    assert "not safe: the broker has every object t.yml derives, but other policies drop" in text


def test_a_policy_the_file_no_longer_gives_a_queue_uncovers_what_it_hid_and_is_warned() -> None:
    """The file drops queue q's ``policy`` block: apply deletes ``rabbit-retry:q``, and a
    company-wide policy of a lower priority (a 3 s message-ttl) applies to q from then on:
    its messages expire into the retry tier over and over until the broker drops them. That
    is the warning, on q. Before, the hazards were read from the broker as it is (our policy
    winning): q got no warning."""
    before = compile_topology(parse_topology(
        "version: 1\nqueues:\n  q:\n    queue_type: classic\n    retry: {delays: [2s]}\n"
        "    policy: {max_length: 1000}\n    on_full: park\n", "t.yml"))
    after = compile_topology(parse_topology(
        "version: 1\nqueues:\n  q:\n    queue_type: classic\n    retry: {delays: [2s]}\n",
        "t.yml"))
    live = _live(before, LivePolicy("rabbit-retry:q", "^q$", "queues", {"max-length": 1000}, 10),
                 LivePolicy("company-ttl", ".*", "all", {"message-ttl": 3000}, 0))
    assert [c.detail for c in diff(after, live) if c.object == "policy"] == [
        "no longer in the file: deleted"]
    lines = hazard_lines(policy_hazards(after, live))
    assert any("company-ttl" in line and "main queue q:" in line for line in lines), lines
    assert not any("rabbit-retry:q" in line for line in lines), lines


def test_the_files_policy_counts_at_the_priority_the_file_gives_it_not_the_brokers() -> None:
    """``plan`` warns about what applies once ``apply`` has run: a file that lowers its own
    policy's priority below another policy's lets that policy's TTL reach the queue (a hazard,
    not only a note), and a policy of ours the broker lacks yet wins as the file says."""
    from dataclasses import replace

    plan = _plan()
    ttl = LivePolicy("company-ttl", ".*", "all", {"message-ttl": 3000}, 5)
    on_broker = _live(plan, ttl)  # ours at priority 10 there: it wins over company-ttl
    assert "orders" not in {h.queue for h in policy_hazards(plan, on_broker)}  # control
    lowered = replace(plan, policies=tuple(replace(p, priority=1) for p in plan.policies))
    hit = [h for h in policy_hazards(lowered, on_broker) if h.queue == "orders"]
    assert [(h.policy.name, h.key, h.value) for h in hit] == [("company-ttl", "message-ttl", 3000)]
    # not on the broker yet: apply creates ours at priority 10, and then it wins
    missing = replace(on_broker, policies=(ttl,))
    assert "orders" not in {h.queue for h in policy_hazards(plan, missing)}
