"""What a main queue's length limit and TTL do to a message (topology/limits.py): the file says
it (``on_full`` / ``on_expire``) or is refused with one line; the compiled route of ``Q``'s
dead letters; what ``plan`` names before a change evicts messages (broker/evictions.py); and
how a message the broker parked reads (``contract.parked_reason``)."""

from __future__ import annotations

import dataclasses

import pytest

from rabbit_retry import contract
from rabbit_retry.broker.diff import diff
from rabbit_retry.broker.evictions import dead_letter_routes, evictions
from rabbit_retry.broker.inspect import LivePolicy, LiveQueue, LiveState
from rabbit_retry.broker.policies import around_routes
from rabbit_retry.errors import InputError
from rabbit_retry.topology import Plan, compile_topology, parse_topology
from rabbit_retry.topology.resolved import from_values, to_values


def _file(queue_type: str, body: str) -> str:
    return (f"version: 1\nqueues:\n  q:\n    queue_type: {queue_type}\n"
            f"    retry: {{delays: [2s]}}\n{body}")


def _refused(text: str) -> str:
    with pytest.raises(InputError) as caught:
        parse_topology(text, "t.yml")
    [line] = str(caught.value).splitlines()
    return line


@pytest.mark.parametrize(("queue_type", "body", "line"), [
    ("classic", "    policy: {max_length: 5}\n",
     "t.yml:6: queues.q.policy.max_length: a length limit needs on_full beside it: park (when "
     "the queue is full, its oldest message moves to q.parking) or drop"),
    ("classic", "    arguments: {x-max-length-bytes: 1000}\n",
     "t.yml:6: queues.q.arguments.x-max-length-bytes: a length limit needs on_full beside it: "
     "park (when the queue is full, its oldest message moves to q.parking) or drop"),
    ("quorum", "    arguments: {x-max-length: 5}\n",
     "t.yml:6: queues.q.arguments.x-max-length: a length limit needs on_full: reject beside it "
     "(when the queue is full, new publishes are refused; publishers with confirms get a nack)"),
    ("classic", "    policy: {message_ttl: 1h}\n",
     "t.yml:6: queues.q.policy.message_ttl: a message TTL needs on_expire beside it: park "
     "(expired messages move to q.parking) or drop"),
    ("quorum", "    policy: {message_ttl: 1h}\n",
     "t.yml:6: queues.q.policy.message_ttl: a message TTL needs on_expire: park beside it "
     "(expired messages move to q.parking)"),
    ("classic", "    policy: {max_length: 5}\n    on_full: reject\n",
     "t.yml:7: queues.q.on_full: a classic queue that refuses publishes also refuses the "
     "retried messages coming back from its tiers while it is full, and drops them; use "
     "on_full: park or drop, or queue_type: quorum"),
    ("quorum", "    policy: {max_length: 5}\n    on_full: park\n",
     "t.yml:7: queues.q.on_full: a full quorum queue refuses new publishes (reject-publish, "
     "which its at-least-once dead-lettering needs): nothing overflows to park or drop; write "
     "on_full: reject"),
    ("quorum", "    policy: {message_ttl: 1h}\n    on_expire: drop\n",
     "t.yml:7: queues.q.on_expire: a quorum queue dead-letters at least once: an expired "
     "message with no route is kept out of sight, not dropped; write on_expire: park "
     "(q.parking)"),
    ("classic", "    policy: {max_length: 5, message_ttl: 1h}\n    on_full: park\n"
     "    on_expire: drop\n",
     "t.yml:8: queues.q.on_expire: on_full: park and on_expire: drop: a classic queue sends the "
     "overflowed and the expired the same way; give both the same value"),
    ("classic", "    policy: {max_length: 5, overflow: reject-publish-dlx}\n    on_full: park\n",
     "t.yml:6: queues.q.policy.overflow: overflow reject-publish-dlx contradicts on_full: park; "
     "leave it out (on_full says what a full queue does)"),
    ("classic", "    on_full: parked\n",
     "t.yml:6: queues.q.on_full: expected 'reject', 'park' or 'drop', got 'parked'"),
])
def test_a_limit_or_ttl_without_a_word_on_the_message_or_a_word_it_cannot_keep_is_refused(
    queue_type: str, body: str, line: str
) -> None:
    assert _refused(_file(queue_type, body)) == line


@pytest.mark.parametrize(("queue_type", "body", "route"), [
    ("classic", "    policy: {max_length: 5}\n    on_full: park\n", "parking"),
    ("classic", "    arguments: {x-max-length: 5}\n    on_full: drop\n", "drop"),
    ("classic", "    policy: {max_length: 5, message_ttl: 1h, overflow: drop-head}\n"
     "    on_full: drop\n    on_expire: drop\n", "drop"),
    ("classic", "    policy: {message_ttl: 1h}\n    on_expire: park\n", "parking"),
    ("quorum", "    policy: {max_length: 5}\n    on_full: reject\n", "tier"),
    ("quorum", "    policy: {max_length: 5, message_ttl: 1m}\n    on_full: reject\n"
     "    on_expire: park\n", "parking"),
    # Without a limit of its own: the route for one another policy may set.
    ("classic", "    on_expire: park\n", "parking"),
    ("quorum", "", "tier"),
])
def test_what_the_file_says_is_where_the_queue_dead_letters_go(
    queue_type: str, body: str, route: str
) -> None:
    topology = parse_topology(_file(queue_type, body), "t.yml")
    [queue] = topology.queues
    assert queue.dead_letter_route == route
    plan = compile_topology(topology)
    keyed = [b.destination for b in plan.bindings if b.routing_key == "q"]
    assert keyed == {"tier": ["q.retry.2s"], "parking": ["q.parking"], "drop": []}[route]
    assert from_values(to_values(topology)) == topology  # the child process carries it


def _plan(queue_type: str, body: str) -> Plan:
    return compile_topology(parse_topology(_file(queue_type, body), "t.yml"))


def _live(plan: Plan, *, ready: int, policy: dict[str, object] | None = None,
          size: int = 0) -> LiveState:
    queues = {q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments))
              for q in plan.queues}
    queues["q"] = dataclasses.replace(queues["q"], messages=ready, messages_ready=ready,
                                      message_bytes_ready=size)
    policies = () if policy is None else (
        LivePolicy("rabbit-retry:q", "^q$", "queues", policy, 10),)
    return LiveState(queues=queues, exchanges={}, bindings=tuple(plan.bindings),
                     policies=policies)


def test_lowering_a_classic_limit_below_what_the_queue_holds_names_the_count_and_where() -> None:
    plan = _plan("classic", "    policy: {max_length: 600}\n    on_full: park\n")
    [eviction] = evictions(plan, _live(plan, ready=800, policy={"max-length": 800}))
    assert eviction.line() == (
        "evicts    queue    q  (max_length 800 -> 600: 200 of its 800 messages leave it at "
        "once, parked in q.parking)")
    assert eviction.to_json()["count"] == 200 and eviction.exact
    dropped = _plan("classic", "    policy: {max_length: 600}\n    on_full: drop\n")
    [eviction] = evictions(dropped, _live(dropped, ready=800))
    assert eviction.detail == ("max_length absent -> 600: 200 of its 800 messages leave it at "
                               "once, dropped (the file says drop)")
    # Positive control above; nothing leaves while the queue holds no more than the limit, or
    # when the limit rises.
    assert evictions(plan, _live(plan, ready=600, policy={"max-length": 800})) == []
    assert evictions(plan, _live(plan, ready=800, policy={"max-length": 500})) == []


def test_a_new_ttl_or_byte_limit_names_an_upper_bound_a_quorum_limit_nothing() -> None:
    plan = _plan("classic", "    policy: {message_ttl: 1h}\n    on_expire: park\n")
    [eviction] = evictions(plan, _live(plan, ready=50))
    assert eviction.detail == ("message_ttl absent -> 1h: up to 50 of its 50 messages leave it "
                               "at once, parked in q.parking")
    assert evictions(plan, _live(plan, ready=50, policy={"message-ttl": 60_000})) == []
    sized = _plan("classic", "    policy: {max_length_bytes: 100}\n    on_full: park\n")
    assert [e.count for e in evictions(sized, _live(sized, ready=3, size=300))] == [3]
    assert evictions(sized, _live(sized, ready=3, size=90)) == []
    quorum = _plan("quorum", "    policy: {max_length: 1}\n    on_full: reject\n")
    assert evictions(quorum, _live(quorum, ready=800)) == []  # publishes refused; none leave


def test_a_queue_that_parks_its_dead_letters_now_leaves_its_first_tier_and_back() -> None:
    before = _plan("classic", "")
    after = _plan("classic", "    policy: {max_length: 5}\n    on_full: park\n")
    changes = diff(after, _live(before, ready=0))
    assert [(c.kind, c.name, c.detail) for c in changes if c.object == "binding"
            and c.kind != "unchanged"] == [
        ("create", "q.retry -> q.parking [q]", ""),
        ("unbind", "q.retry -> q.retry.2s [q]",
         "what q dead-letters (overflowed, expired) no longer goes to a tier, from which the "
         "broker would drop it"),
    ]
    changes = diff(before, _live(after, ready=0))
    assert [(c.kind, c.name, c.detail) for c in changes if c.object == "binding"
            and c.kind != "unchanged"] == [
        ("create", "q.retry -> q.retry.2s [q]", ""),
        ("unbind", "q.retry -> q.parking [q]", "the file no longer parks what q dead-letters"),
    ]


@pytest.mark.parametrize(("headers", "reason"), [
    ({"parked-reason": "exhausted", "x-death": [{"reason": "maxlen"}]}, "exhausted"),
    ({"x-death": [{"reason": "maxlen", "queue": "q"}, {"reason": "expired"}]}, "queue-full"),
    ({"x-death": [{"reason": b"expired", "queue": "q"}]}, "expired"),
    ({"x-death": [{"reason": "delivery_limit"}]}, "delivery-limit"),
    ({"x-death": "garbled"}, None),
    ({"x-death": [{"reason": "who knows"}]}, None),
    ({}, None),
])
def test_a_message_the_broker_parked_reads_its_reason_from_its_newest_death(
    headers: dict[str, object], reason: str | None
) -> None:
    assert contract.parked_reason(headers) == reason


def test_a_limit_is_set_after_its_route_exists_and_removed_before_its_route_goes() -> None:
    plain = _plan("classic", "")
    parked = _plan("classic", "    policy: {max_length: 5}\n    on_full: park\n")
    adding = diff(parked, _live(plain, ready=0))
    assert around_routes(parked, adding) == (
        [], [c for c in adding if c.object == "policy"])
    removing = diff(plain, _live(parked, ready=0, policy={"max-length": 5}))
    [deletion] = [c for c in removing if c.object == "policy"]
    assert deletion.detail == "no longer in the file: deleted"
    assert around_routes(plain, removing) == ([deletion], [])


def test_a_queue_migrate_rebuilds_under_a_lower_argument_limit_names_what_does_not_fit() -> None:
    plan = _plan("classic", "    arguments: {x-max-length: 600}\n    on_full: park\n")
    live = _live(plan, ready=800)
    live.queues["q"] = dataclasses.replace(live.queues["q"], arguments={
        k: v for k, v in live.queues["q"].arguments.items() if k != "x-max-length"})
    [eviction] = evictions(plan, live)
    assert eviction.detail == ("x-max-length (migrate) absent -> 600: 200 of its 800 messages "
                               "leave it at once, parked in q.parking")
    assert evictions(plan, _live(plan, ready=800)) == []  # already so: nothing is rebuilt


def test_migrate_moves_only_a_route_to_parking_or_nowhere_never_to_a_tier_not_made_yet() -> None:
    plain = _plan("classic", "")
    parked = _plan("classic", "    arguments: {x-max-length: 5}\n    on_full: park\n")
    moved = dead_letter_routes(parked, diff(parked, _live(plain, ready=0)), ["q"])
    assert [(c.kind, c.name) for c in moved] == [
        ("create", "q.retry -> q.parking [q]"), ("unbind", "q.retry -> q.retry.2s [q]")]
    assert dead_letter_routes(parked, diff(parked, _live(plain, ready=0)), ["other"]) == []
    # Back to a tier (here a new one, which apply declares): left to apply.
    later = compile_topology(parse_topology(_file("classic", "").replace("[2s]", "[5s]"), "t"))
    assert dead_letter_routes(later, diff(later, _live(parked, ready=0)), ["q"]) == []


def test_apply_with_a_target_reports_and_refuses_only_the_evictions_it_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``apply --target a`` changes nothing of queue ``b``: a lower limit the file gives ``b``
    (800 messages held, 600 in the file) is not this apply's eviction. Before, apply checked the
    whole file a second time and refused (exit 3) naming ``b``, or with --accept-evictions said
    it evicted from ``b``; plan --target listed it too."""
    from rabbit_retry.broker.diff import select
    from rabbit_retry.cli import provision

    text = """\
version: 1
queues:
  a:
    queue_type: classic
    retry: {delays: [2s]}
  b:
    queue_type: classic
    retry: {delays: [2s]}
    policy: {max_length: 600}
    on_full: park
"""
    plan = compile_topology(parse_topology(text, "t.yml"))
    live = LiveState(
        {q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                           messages=800 if q.name == "b" else 0,
                           messages_ready=800 if q.name == "b" else 0)
         for q in plan.queues if q.name != "a.retry.2s"},  # a has work: its tier is missing
        {}, tuple(plan.bindings),
        policies=(LivePolicy("rabbit-retry:b", "^b$", "queues", {"max-length": 800}, 10),))
    assert evictions(plan, live) and not evictions(select(plan, ["a"]), live)  # the control
    changes = diff(plan, live, targets=["a"])

    class Past(Exception):
        """The eviction check was passed."""

    def past(_changes: object) -> list[str]:
        raise Past

    monkeypatch.setattr(provision, "_read", lambda *args, **kwargs: (changes, live))
    monkeypatch.setattr(provision, "unsendable", past)
    settings = dataclasses.make_dataclass("S", [("vhost", str)])("/")
    with pytest.raises(Past):
        provision._apply(settings, plan, "t.yml", False, False, False, ["a"], False)


def test_raising_the_policys_priority_over_a_winning_one_evicts_what_its_limit_leaves_out() -> None:
    """Our policy (max-length 100) loses to another of a higher priority that sets no limit,
    so the classic queue holds 500. Raising ``policy.priority`` above it brings our limit in at
    once: 400 leave the queue. Before, the eviction was measured against our policy as it is
    on the broker (100 then, 100 after: nothing), and apply went on without
    --accept-evictions."""
    text = ("version: 1\nqueues:\n  q:\n    queue_type: classic\n    retry: {delays: [2s]}\n"
            "    policy: {max_length: 100, priority: 60}\n    on_full: park\n")
    plan = compile_topology(parse_topology(text, "t.yml"))
    live = LiveState(
        queues={q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                           messages=500 if q.name == "q" else 0,
                           messages_ready=500 if q.name == "q" else 0) for q in plan.queues},
        exchanges={}, bindings=tuple(plan.bindings),
        policies=(LivePolicy("rabbit-retry:q", "^q$", "queues", {"max-length": 100}, 10),
                  LivePolicy("team", "^q", "queues", {"queue-mode": "lazy"}, 50)))
    assert [c.kind for c in diff(plan, live) if c.object == "policy"] == ["update"]
    [evicted] = evictions(plan, live)
    assert (evicted.queue, evicted.count) == ("q", 400)


@pytest.mark.parametrize("kind,on_full", [("classic", "park"), ("classic", "drop"),
                                          ("quorum", "reject")])
def test_a_rename_names_what_the_moved_messages_evict_from_the_new_queue(
    kind: str, on_full: str,
) -> None:
    """``renamed_from``: 300 in the old queue and 50 in the new one, whose limit is 200 and
    live already (apply made it): 150 do not fit. Before, nothing was named: the limit was
    not lowered, so ``evictions`` saw no change."""
    from rabbit_retry.broker.evictions import moved_in

    text = (f"version: 1\nqueues:\n  new:\n    queue_type: {kind}\n    retry: {{delays: [2s]}}\n"
            f"    renamed_from: old\n    policy: {{max_length: 200}}\n"
            f"    on_full: {on_full}\n")
    plan = compile_topology(parse_topology(text, "t.yml"))
    held = {"new": 50, "old": 300}
    live = LiveState(
        queues={n: LiveQueue(n, kind, True, False, {}, messages=held.get(n, 0),
                             messages_ready=held.get(n, 0))
                for n in [*(q.name for q in plan.queues), "old"]},
        exchanges={}, bindings=tuple(plan.bindings),
        policies=(LivePolicy("rabbit-retry:new", "^new$", "queues", {"max-length": 200}, 10),))
    assert evictions(plan, live) == []
    [evicted] = moved_in(plan, live, "old", [("old", "new"), ("old.parking", "new.parking")])
    fate = {"park": "leave it at once, parked in new.parking",
            "drop": "leave it at once, dropped (the file says drop)",
            "reject": "do not fit; it refuses them (on_full: reject, with --accept-evictions "
                      "too) and they stay in old"}[on_full]
    many = "up to 150" if on_full == "reject" else "150"
    assert evicted.line() == (f"evicts    queue    new  (max_length 200 with the messages of "
                              f"old moved in: {many} of its 350 messages {fate})")
    assert evicted.to_json()["renamed_from"] == "old"
