"""Exports: RabbitMQ definitions JSON (per-vhost import) and a Mermaid diagram."""

from __future__ import annotations

import json
import re

from rabbit_retry.topology import Binding, Exchange, Plan, Queue, compile_topology, parse_topology
from rabbit_retry.topology.export import to_definitions, to_mermaid

ORDERS = """\
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.fraud-check:
    bindings: [{exchange: orders, routing_key: order.created}]
    retry: {delays: [5s, 30s], max_attempts: 5}
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [10s], max_attempts: 3}
    arguments: {x-max-length: 100000, x-custom: [a, b]}
    on_full: park
"""


def plan_of(text: str) -> Plan:
    return compile_topology(parse_topology(text))


# --- definitions --------------------------------------------------------------------------------


def test_definitions_hold_every_object_in_the_broker_format() -> None:
    plan = plan_of(ORDERS)
    definitions = to_definitions(plan)
    assert set(definitions) == {"exchanges", "queues", "bindings", "policies"}
    assert definitions["policies"] == []  # no policy: block in the file
    assert definitions["exchanges"][0] == {
        "name": "orders",
        "type": "topic",
        "durable": True,
        "auto_delete": False,
        "internal": False,
        "arguments": {},
    }
    assert definitions["exchanges"][1] == {
        "name": "orders.fraud-check.retry",
        "type": "direct",
        "durable": True,
        "auto_delete": False,
        "internal": False,
        "arguments": {},
    }
    assert definitions["queues"][0] == {
        "name": "orders.fraud-check",
        "durable": True,
        "auto_delete": False,
        "arguments": {
            "x-queue-type": "quorum",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
            "x-dead-letter-exchange": "orders.fraud-check.retry",
            "x-dead-letter-routing-key": "orders.fraud-check",
        },
    }
    assert definitions["bindings"][:2] == [
        {
            "source": "orders",
            "destination": "orders.fraud-check",
            "destination_type": "queue",
            "routing_key": "order.created",
            "arguments": {},
        },
        {
            "source": "orders.fraud-check.retry",
            "destination": "orders.fraud-check.retry.5s",
            "destination_type": "queue",
            "routing_key": "5s",
            "arguments": {},
        },
    ]


def test_definitions_mirror_the_plan_one_to_one() -> None:
    plan = plan_of(ORDERS)
    definitions = to_definitions(plan)
    assert [e["name"] for e in definitions["exchanges"]] == [e.name for e in plan.exchanges]
    assert [q["name"] for q in definitions["queues"]] == [q.name for q in plan.queues]
    assert [dict(q["arguments"]) for q in definitions["queues"]] == [
        dict(q.arguments) for q in plan.queues
    ]
    assert [(b["source"], b["destination"], b["routing_key"]) for b in definitions["bindings"]] == [
        (b.source, b.destination, b.routing_key) for b in plan.bindings
    ]
    assert all(
        q["arguments"]["x-queue-type"] in ("quorum", "classic") for q in definitions["queues"]
    )


def test_definitions_carry_each_policy_block_as_apply_puts_it() -> None:
    plan = plan_of(ORDERS.replace(
        "    arguments: {x-max-length: 100000, x-custom: [a, b]}\n",
        "    policy: {max_length: 5000, message_ttl: 1d, priority: 20}\n    on_expire: park\n",
    ))
    (policy,) = plan.policies
    assert to_definitions(plan)["policies"] == [{
        "name": "rabbit-retry:orders.email",
        "pattern": "^orders\\.email$",
        "apply-to": "queues",
        "definition": {"max-length": 5000, "message-ttl": 86_400_000},
        "priority": 20,
    }]
    assert dict(policy.definition) == {"max-length": 5000, "message-ttl": 86_400_000}
    assert "policy max-length 5000, message-ttl 86400000" in to_mermaid(plan)


def test_definitions_name_no_vhost_and_are_plain_json() -> None:
    definitions = to_definitions(plan_of(ORDERS))
    text = json.dumps(definitions)
    assert json.loads(text) == definitions
    for kind in ("exchanges", "queues", "bindings", "policies"):
        for item in definitions[kind]:
            assert "vhost" not in item
    email = next(q for q in definitions["queues"] if q["name"] == "orders.email")
    assert email["arguments"]["x-custom"] == ["a", "b"]
    assert email["arguments"]["x-max-length"] == 100000


def test_changing_the_export_does_not_change_the_plan() -> None:
    plan = plan_of(ORDERS)
    definitions = to_definitions(plan)
    definitions["queues"][0]["arguments"]["x-overflow"] = "drop-head"
    definitions["bindings"][0]["arguments"]["k"] = 1
    assert plan.queues[0].arguments["x-overflow"] == "reject-publish"
    assert dict(plan.bindings[0].arguments) == {}


# --- mermaid ------------------------------------------------------------------------------------

NODE = re.compile(r'^ +(?P<id>[a-z]\d+)(?:\{\{|\[\()"(?P<label>[^"]*)"(?:\}\}|\)\])$')
EDGE = re.compile(
    r'^ +(?P<src>[a-z]\d+) (?P<arrow>-->|-\.->|==>)(?:\|"(?P<text>[^"]*)"\|)? (?P<dst>[a-z]\d+)$'
)


OTHER = re.compile(
    r'^  (%%.*|subgraph g\d+\["[^"]*"\]|end|classDef \w+ .*|class [a-z0-9,]+ \w+)$'
    r"|^    direction LR$"
)


def parse(diagram: str) -> tuple[dict[str, str], list[tuple[str, str, str, str]]]:
    """Node id -> label, and edges (source id, arrow, text, destination id); fails on any
    line it does not recognise, so a malformed diagram cannot pass."""
    lines = diagram.splitlines()
    assert lines[0] == "flowchart LR"
    nodes: dict[str, str] = {}
    edges: list[tuple[str, str, str, str]] = []
    for line in lines[1:]:
        if node := NODE.match(line):
            assert node["id"] not in nodes, f"node defined twice: {line}"
            nodes[node["id"]] = node["label"]
        elif edge := EDGE.match(line):
            edges.append((edge["src"], edge["arrow"], edge["text"] or "", edge["dst"]))
        else:
            assert OTHER.match(line), f"unexpected line: {line!r}"
    for src, _, _, dst in edges:
        assert src in nodes and dst in nodes
    return nodes, edges


def node_named(nodes: dict[str, str], name: str) -> str:
    [found] = [node_id for node_id, text in nodes.items() if text.split("<br/>")[0] == name]
    return found


def test_mermaid_draws_the_retry_loop_of_each_queue() -> None:
    diagram = to_mermaid(plan_of(ORDERS))
    assert diagram.endswith("\n")
    nodes, edges = parse(diagram)
    main = node_named(nodes, "orders.fraud-check")
    retry = node_named(nodes, "orders.fraud-check.retry")
    tier5 = node_named(nodes, "orders.fraud-check.retry.5s")
    tier30 = node_named(nodes, "orders.fraud-check.retry.30s")
    parking = node_named(nodes, "orders.fraud-check.parking")
    orders = node_named(nodes, "orders")
    assert nodes[orders] == "orders<br/>topic"
    assert nodes[tier5] == "orders.fraud-check.retry.5s<br/>quorum, TTL 5s"
    assert nodes[tier30] == "orders.fraud-check.retry.30s<br/>quorum, TTL 30s"
    assert nodes[parking] == "orders.fraud-check.parking<br/>parking, never expires"
    assert (orders, "-->", "order.created", main) in edges
    assert (main, "-.->", "reject / retry", retry) in edges
    assert (retry, "-->", "5s, orders.fraud-check", tier5) in edges
    assert (retry, "-->", "30s", tier30) in edges
    assert (tier5, "-.->", "after 5s", main) in edges
    assert (tier30, "-.->", "after 30s", main) in edges
    assert (main, "==>", "park", parking) in edges
    email = node_named(nodes, "orders.email")
    assert nodes[email] == "orders.email<br/>classic queue"
    assert (node_named(nodes, "orders.email.retry.10s"), "-.->", "after 10s", email) in edges
    # one node per object in the plan: 3 exchanges, 7 queues
    assert len(nodes) == 10
    assert diagram.count("subgraph ") == 2


def test_mermaid_ids_are_safe_for_names_with_punctuation() -> None:
    text = """\
version: 1
exchanges:
  "ev#nts-x.y": {type: topic}
  "a b/c": {type: fanout}
queues:
  "a.b-c#d:e@f":
    bindings:
      - {exchange: "ev#nts-x.y", routing_key: "k.#.*"}
      - {exchange: "a b/c"}
      - {exchange: amq.topic, routing_key: "<b>&|\\"q\\""}
    retry: {delays: [1500ms]}
"""
    diagram = to_mermaid(plan_of(text))
    nodes, edges = parse(diagram)
    labels = " ".join(nodes.values())
    assert "ev#35;nts-x.y<br/>topic" in labels
    assert "a b/c<br/>fanout" in labels
    assert "a.b-c#35;d:e@f.retry.1500ms<br/>quorum, TTL 1500ms" in labels
    assert "amq.topic<br/>built-in exchange" in labels
    texts = [t for _, _, t, _ in edges]
    assert "k.#35;.*" in texts
    assert "#60;b#62;#38;#124;#34;q#34;" in texts
    for node_id in nodes:
        assert re.fullmatch(r"[xq]\d+", node_id)
    _only_entities(diagram)


def test_mermaid_survives_any_name_in_a_hand_built_plan() -> None:
    # The loader refuses these names; the diagram must not depend on that.
    weird = 'q*"`[x]{y}|<z>&;%%end'
    plan = Plan(
        exchanges=(Exchange('e"*#', "topic"), Exchange(f"{weird}.retry", "direct", owner=weird)),
        queues=(
            Queue(weird, "main", weird, {"x-dead-letter-exchange": f"{weird}.retry"}),
            Queue(f"{weird}.retry.1s", "tier", weird, {"x-message-ttl": 1000}, delay_ms=1000),
            Queue(f"{weird}.parking", "parking", weird),
        ),
        bindings=(
            Binding('e"*#', weird, "a\nb"),
            Binding(f"{weird}.retry", f"{weird}.retry.1s", "1s"),
        ),
    )
    diagram = to_mermaid(plan)
    nodes, edges = parse(diagram)
    assert len(nodes) == 5 and len(edges) == 5
    assert (
        "q*#34;#96;#91;x#93;#123;y#125;#124;#60;z#62;#38;;#37;#37;end<br/>classic queue"
        in nodes.values()
    )
    assert ("x0", "-->", "a b", "q0") in edges  # a newline in a key is drawn as a space
    _only_entities(diagram)


def _only_entities(diagram: str) -> None:
    """Every '#' outside a colour starts a Mermaid entity such as '#35;'."""
    for line in diagram.splitlines():
        if "classDef" not in line:
            assert not re.search(r"#(?!\d+;)", line), line


def test_mermaid_keeps_an_exchange_and_a_queue_of_the_same_name_apart() -> None:
    text = "version: 1\nexchanges: {audit: {type: fanout}}\n"
    text += "queues: {audit: {bindings: [{exchange: audit}]}}\n"
    nodes, edges = parse(to_mermaid(plan_of(text)))
    exchange = next(i for i, t in nodes.items() if t == "audit<br/>fanout")
    queue = next(i for i, t in nodes.items() if t == "audit<br/>quorum queue")
    assert exchange != queue
    assert (exchange, "-->", "", queue) in edges


def test_mermaid_is_deterministic() -> None:
    assert to_mermaid(plan_of(ORDERS)) == to_mermaid(plan_of(ORDERS))
