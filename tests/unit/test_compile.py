"""The compiler: one queue Q -> every broker object of the README's "What one queue `Q` compiles
to", argument by argument."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rabbit_retry.topology import Binding, Exchange, Plan, Queue, compile_topology, parse_topology
from rabbit_retry.topology.durations import label

QUORUM = """\
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.fraud-check:
    bindings:
      - {exchange: orders, routing_key: order.created}
    retry: {delays: [5s, 30s, 5m], max_attempts: 5}
"""

CLASSIC = """\
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [10s], max_attempts: 3}
    arguments: {x-max-length: 100000}
    on_full: park
"""


def plan_of(text: str) -> Plan:
    return compile_topology(parse_topology(text))


def queue(plan: Plan, name: str) -> Queue:
    [found] = [q for q in plan.queues if q.name == name]
    return found


def test_quorum_queue_compiles_to_exactly_these_objects() -> None:
    plan = plan_of(QUORUM)
    q = "orders.fraud-check"
    quorum = {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once"}
    quorum["x-overflow"] = "reject-publish"
    assert plan.exchanges == (
        Exchange("orders", "topic", durable=True, auto_delete=False, internal=False),
        Exchange(f"{q}.retry", "direct", durable=True, role="retry-exchange", owner=q),
    )
    assert plan.queues == (
        Queue(
            q,
            "main",
            q,
            {**quorum, "x-dead-letter-exchange": f"{q}.retry", "x-dead-letter-routing-key": q},
        ),
        *(
            Queue(
                f"{q}.retry.{text}",
                "tier",
                q,
                {
                    **quorum,
                    "x-message-ttl": ms,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": q,
                },
                delay_ms=ms,
            )
            for text, ms in (("5s", 5_000), ("30s", 30_000), ("5m", 300_000))
        ),
        Queue(f"{q}.parking", "parking", q,
              {"x-queue-type": "quorum", "x-delivery-limit": 2_147_483_647}),
    )
    assert plan.bindings == (
        Binding("orders", q, "order.created"),
        Binding(f"{q}.retry", f"{q}.retry.5s", "5s"),
        Binding(f"{q}.retry", f"{q}.retry.5s", q),
        Binding(f"{q}.retry", f"{q}.retry.30s", "30s"),
        Binding(f"{q}.retry", f"{q}.retry.5m", "5m"),
    )
    assert all(x.durable for x in plan.queues) and all(e.durable for e in plan.exchanges)
    assert [m.name for m in plan.main_queues] == [q]
    assert len(plan.queues_of(q)) == 5


def test_classic_queue_compiles_to_exactly_these_objects() -> None:
    plan = plan_of(CLASSIC)
    q = "orders.email"
    assert queue(plan, q).arguments == {
        "x-max-length": 100000,
        "x-queue-type": "classic",
        "x-dead-letter-exchange": f"{q}.retry",
        "x-dead-letter-routing-key": q,
    }
    assert queue(plan, f"{q}.retry.10s").arguments == {
        "x-queue-type": "classic",
        "x-message-ttl": 10_000,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": q,
    }
    assert queue(plan, f"{q}.parking").arguments == {"x-queue-type": "classic"}
    assert [q.queue_type for q in plan.queues] == ["classic"] * 3
    # What overflows (dead-lettered with key Q) is parked, never sent round a tier.
    assert plan.bindings == (
        Binding("orders", q, "order.*"),
        Binding(f"{q}.retry", f"{q}.retry.10s", "10s"),
        Binding(f"{q}.retry", f"{q}.parking", q),
    )


def test_dead_letters_of_q_go_to_the_first_tier_to_parking_or_nowhere_as_the_file_says() -> None:
    def keyed(text: str, name: str) -> list[str]:
        plan = plan_of(text)
        return [b.destination for b in plan.bindings
                if b.source == f"{name}.retry" and b.routing_key == name]

    q = "orders.email"
    assert keyed(CLASSIC, q) == [f"{q}.parking"]
    assert keyed(CLASSIC.replace("on_full: park", "on_full: drop"), q) == []
    policy = "    policy: {message_ttl: 1h}\n"
    assert keyed(CLASSIC.replace("on_full: park", "on_full: drop\n    on_expire: drop\n" +
                                 policy), q) == []
    assert keyed(CLASSIC.replace("    arguments: {x-max-length: 100000}\n    on_full: park\n",
                                 ""), q) == [f"{q}.retry.10s"]
    f = "orders.fraud-check"
    assert keyed(QUORUM, f) == [f"{f}.retry.5s"]
    assert keyed(QUORUM + "    policy: {max_length: 5}\n    on_full: reject\n", f) == [
        f"{f}.retry.5s"]  # a full quorum queue refuses publishes: nothing overflows
    assert keyed(QUORUM + "    policy: {message_ttl: 1m}\n    on_expire: park\n", f) == [
        f"{f}.parking"]


def test_tiers_have_the_queue_type_of_their_main_queue() -> None:
    plan = plan_of(QUORUM)
    tiers = [q for q in plan.queues if q.role == "tier"]
    assert [t.queue_type for t in tiers] == ["quorum"] * 3


def test_parking_queue_follows_the_main_queue_and_never_expires_or_drops() -> None:
    for text, name in ((QUORUM, "orders.fraud-check"), (CLASSIC, "orders.email")):
        parking = queue(plan_of(text), f"{name}.parking")
        assert parking.role == "parking" and parking.durable
        assert parking.queue_type == queue(plan_of(text), name).queue_type
        limits = {"x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes", "x-overflow"}
        assert not limits & set(parking.arguments)
        assert "x-dead-letter-exchange" not in parking.arguments


def test_the_file_can_keep_a_quorum_queues_parking_classic() -> None:
    for text in (
        "version: 1\nqueues:\n  q: {parking: {queue_type: classic}}\n",
        "version: 1\ndefaults: {parking: {queue_type: classic}}\nqueues:\n  q: {}\n",
    ):
        plan = plan_of(text)
        assert queue(plan, "q").queue_type == "quorum"
        assert queue(plan, "q.parking").arguments == {"x-queue-type": "classic"}


def test_main_queue_arguments_do_not_depend_on_the_delays() -> None:
    one = queue(plan_of(QUORUM), "orders.fraud-check")
    other = queue(plan_of(QUORUM.replace("[5s, 30s, 5m]", "[1s]")), "orders.fraud-check")
    assert one.arguments == other.arguments


def test_repeated_delays_share_one_tier_and_keep_first_seen_order() -> None:
    plan = plan_of(
        "version: 1\nqueues:\n  q: {retry: {delays: [5s, 5000, 30s, 30s, 1m], max_attempts: 9}}\n"
    )
    tiers = [q for q in plan.queues if q.role == "tier"]
    assert [t.name for t in tiers] == ["q.retry.5s", "q.retry.30s", "q.retry.1m"]
    assert [t.delay_ms for t in tiers] == [5_000, 30_000, 60_000]
    assert [(b.destination, b.routing_key) for b in plan.bindings] == [
        ("q.retry.5s", "5s"),
        ("q.retry.5s", "q"),
        ("q.retry.30s", "30s"),
        ("q.retry.1m", "1m"),
    ]


def test_user_arguments_pass_through_beside_the_managed_ones() -> None:
    plan = plan_of(
        """\
version: 1
queues:
  q:
    on_full: reject
    arguments:
      x-max-length: 10
      x-delivery-limit: 3
      x-single-active-consumer: true
      custom: [a, 1]
"""
    )
    main = queue(plan, "q")
    assert {k: main.arguments[k] for k in ("x-max-length", "x-delivery-limit")} == {
        "x-max-length": 10,
        "x-delivery-limit": 3,
    }
    assert main.arguments["x-single-active-consumer"] is True
    assert main.arguments["custom"] == ["a", 1]
    assert main.arguments["x-overflow"] == "reject-publish"
    tier = queue(plan, "q.retry.5s")
    assert not {"x-max-length", "x-delivery-limit", "custom"} & set(tier.arguments)


def test_user_bindings_keep_their_arguments() -> None:
    plan = plan_of(
        """\
version: 1
exchanges: {h: {type: headers}}
queues:
  q: {bindings: [{exchange: h, arguments: {x-match: all, kind: a}}, {exchange: amq.topic}]}
"""
    )
    assert plan.bindings[:2] == (
        Binding("h", "q", "", {"x-match": "all", "kind": "a"}),
        Binding("amq.topic", "q", ""),
    )


def test_defaults_are_merged_before_compiling() -> None:
    plan = plan_of(
        """\
version: 1
defaults:
  queue_type: classic
  retry: {delays: [1s, 2s]}
queues:
  a: {}
  b: {queue_type: quorum}
"""
    )
    assert [q.name for q in plan.queues] == [
        "a",
        "a.retry.1s",
        "a.retry.2s",
        "a.parking",
        "b",
        "b.retry.1s",
        "b.retry.2s",
        "b.parking",
    ]
    assert queue(plan, "a.retry.2s").queue_type == "classic"
    assert queue(plan, "b.retry.2s").queue_type == "quorum"
    assert [e.name for e in plan.exchanges] == ["a.retry", "b.retry"]


def test_a_queue_named_like_a_label_gets_one_binding_per_key() -> None:
    plan = plan_of("version: 1\nqueues:\n  '5s': {retry: {delays: [5s, 10s]}}\n")
    keys = [b.key for b in plan.bindings]
    assert len(keys) == len(set(keys)) == 2


def test_the_main_queue_dead_letters_to_the_first_tier() -> None:
    """What the broker dead-letters from Q (routing key Q via Q.retry) reaches the first tier."""
    plan = plan_of(QUORUM)
    main = queue(plan, "orders.fraud-check")
    exchange, key = (
        main.arguments["x-dead-letter-exchange"],
        main.arguments["x-dead-letter-routing-key"],
    )
    [target] = [
        b.destination for b in plan.bindings if (b.source, b.routing_key) == (exchange, key)
    ]
    assert target == "orders.fraud-check.retry.5s"


@given(st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=8).map(sorted))
def test_each_tier_routes_by_its_label_and_returns_to_q_alone(delays: list[int]) -> None:
    text = "version: 1\nqueues:\n  q:\n    retry: {delays: [" + ", ".join(map(str, delays)) + "]}\n"
    plan = plan_of(text)
    tiers = [q for q in plan.queues if q.role == "tier"]
    assert [t.delay_ms for t in tiers] == list(dict.fromkeys(delays))
    routes = {(b.source, b.routing_key): b.destination for b in plan.bindings}
    for tier in tiers:
        assert tier.delay_ms is not None
        assert (
            routes[("q.retry", label(tier.delay_ms))]
            == tier.name
            == f"q.retry.{label(tier.delay_ms)}"
        )
        assert tier.arguments["x-message-ttl"] == tier.delay_ms
        assert (
            tier.arguments["x-dead-letter-exchange"],
            tier.arguments["x-dead-letter-routing-key"],
        ) == ("", "q")


REPLICATED = """\
version: 1
defaults:
  parking: {queue_type: quorum}
  replicas: 3
queues:
  jobs: {}
  mail:
    queue_type: classic
  local:
    queue_type: classic
    parking: {queue_type: classic}
"""


def test_a_quorum_parking_queue_has_a_limit_no_look_reaches_and_nowhere_to_drop_to() -> None:
    plan = plan_of(REPLICATED)
    assert queue(plan, "jobs.parking").arguments == {
        "x-queue-type": "quorum",
        "x-delivery-limit": 2_147_483_647,
        "x-quorum-initial-group-size": 3,
    }
    # a classic main queue may still park into a replicated queue
    assert queue(plan, "mail.parking").arguments["x-queue-type"] == "quorum"
    assert queue(plan, "local.parking").arguments == {"x-queue-type": "classic"}


def test_replicas_reach_every_quorum_queue_of_q_and_no_classic_one() -> None:
    plan = plan_of(REPLICATED)
    sizes = {q.name: q.arguments.get("x-quorum-initial-group-size") for q in plan.queues}
    assert {n for n, size in sizes.items() if size == 3} == {
        "jobs", "jobs.retry.5s", "jobs.retry.30s", "jobs.retry.5m", "jobs.parking",
        "mail.parking",
    }
    assert {n for n, size in sizes.items() if size is None} == {
        "mail", "mail.retry.5s", "mail.retry.30s", "mail.retry.5m",
        "local", "local.retry.5s", "local.retry.30s", "local.retry.5m", "local.parking",
    }
