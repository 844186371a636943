"""Quorum queue replicas without a broker: status's warnings and view, plan's advice when the
file's ``replicas`` and a live queue disagree."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from rabbit_retry.broker.diff import count, diff, nothing_to_do
from rabbit_retry.broker.inspect import LiveExchange, LiveQueue, LiveState, parse_queue
from rabbit_retry.broker.replicas import Replication, wanted_replicas
from rabbit_retry.status import Status, build_status, status_view
from rabbit_retry.topology import Plan, compile_topology, parse_topology

NODES = ("c1@h", "c2@h", "c3@h")


def topology(replicas: int | None) -> Plan:
    line = f"  replicas: {replicas}\n" if replicas is not None else ""
    text = (
        "version: 1\ndefaults:\n  parking: {queue_type: quorum}\n" + line
        + "queues:\n  orders:\n    retry: {delays: [1s], max_attempts: 2}\n"
    )
    return compile_topology(parse_topology(text, "t.yml"))


def live_of(plan: Plan, *, members: tuple[str, ...] = NODES, online: tuple[str, ...] = NODES,
            arguments_from: Plan | None = None, nodes: tuple[str, ...] = NODES) -> LiveState:
    """What apply of ``arguments_from`` (default: ``plan``) left, each quorum queue with these
    members, led by the first online one."""
    source = arguments_from or plan
    queues = {
        q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                          leader=online[0] if online else None, members=members, online=online)
        for q in source.queues
    }
    exchanges = {e.name: LiveExchange(e.name, e.type, e.durable, e.auto_delete, e.internal,
                                      dict(e.arguments)) for e in source.exchanges}
    return LiveState(queues, exchanges, source.bindings, nodes=nodes, vhost="shop")


def test_the_management_api_fields_are_read() -> None:
    queue = parse_queue({"name": "q", "type": "quorum", "leader": "c2@h",
                         "members": ["c1@h", "c2@h"], "online": ["c2@h"]})
    assert (queue.leader, queue.members, queue.online) == ("c2@h", ("c1@h", "c2@h"), ("c2@h",))
    classic = parse_queue({"name": "q", "type": "classic", "node": "c1@h"})
    assert (classic.leader, classic.members, classic.online) == (None, (), ())


def test_a_replica_offline_is_a_warning_and_a_lost_majority_says_so() -> None:
    one_down = Replication("q", "c1@h", NODES, ("c1@h", "c3@h"))
    assert one_down.warning == "q: 2 of 3 replicas online (c2@h down)"
    two_down = Replication("q", "c1@h", NODES, ("c1@h",))
    assert two_down.warning == (
        "q: 1 of 3 replicas online (c2@h, c3@h down); no majority: the queue takes and hands "
        "out nothing until a node is back")
    assert Replication("q", "c1@h", NODES, NODES).warning is None


def test_fewer_members_than_the_file_asks_is_a_warning_capped_at_the_cluster_size() -> None:
    short = Replication("q", "c1@h", ("c1@h",), ("c1@h",), asked=3, nodes=NODES)
    assert short.warning == "q: 1 replica, the file asks for 3"
    capped = Replication("q", "c1@h", NODES, NODES, asked=5, nodes=NODES)
    assert capped.warning is None  # the broker gives at most one per node
    assert wanted_replicas(5, NODES) == 3 and wanted_replicas(5, ()) == 5
    assert wanted_replicas(None, NODES) is None
    single = Replication("q", "r@h", ("r@h",), ("r@h",), asked=3, nodes=("r@h",))
    assert single.warning is None  # one node: one replica is all there can be
    short5 = Replication("q", "c1@h", ("c1@h",), ("c1@h",), asked=5, nodes=NODES)
    assert short5.warning == "q: 1 replica, the file asks for 5 (at most 3 on this cluster)"


def test_status_lists_every_quorum_queue_of_q_with_its_warning_in_json_and_view() -> None:
    plan = topology(None)
    live = live_of(plan, online=("c1@h", "c3@h"))
    status = build_status(plan, live, diff(plan, live), vhost="shop", source="t.yml")
    (orders,) = status.queues
    assert [r.queue for r in orders.replicas] == [
        "orders", "orders.retry.1s", "orders.parking"]
    data = status.to_json()
    assert data["ok"] is True  # a replica down is not drift: exit 0
    assert data["warnings"] == [
        f"{name}: 2 of 3 replicas online (c2@h down)"
        for name in ("orders", "orders.retry.1s", "orders.parking")]
    assert data["queues"][0]["replicas"][0] == {
        "queue": "orders", "leader": "c1@h", "members": list(NODES),
        "online": ["c1@h", "c3@h"], "replicas_asked": None,
        "warning": "orders: 2 of 3 replicas online (c2@h down)"}
    text = render(status)
    assert "quorum queues" in text and "c2@h (down)" in text and " 2/3 " in text
    assert "WARNING: orders.parking: 2 of 3 replicas online (c2@h down)" in text


def test_status_without_warnings_on_a_cluster_shows_leaders_and_on_one_node_nothing() -> None:
    plan = topology(None)
    live = live_of(plan)
    status = build_status(plan, live, diff(plan, live), vhost="shop", source="t.yml")
    assert status.warnings == ()
    text = render(status)
    assert "quorum queues" in text and "WARNING" not in text and " 3/3 " in text
    single = live_of(plan, members=("r@h",), online=("r@h",), nodes=("r@h",))
    alone = build_status(plan, single, diff(plan, single), vhost="shop", source="t.yml")
    assert alone.warnings == () and "quorum queues" not in render(alone)
    assert alone.to_json()["queues"][0]["replicas"][0]["leader"] == "r@h"


def test_plan_replicas_added_to_live_queues_with_every_member_is_nothing_to_do() -> None:
    live = live_of(topology(None))  # applied before the file set replicas
    changes = diff(topology(3), live)
    orders = next(c for c in changes if c.name == "orders")
    assert orders.kind == "unchanged"
    assert orders.detail == (
        "x-quorum-initial-group-size: live absent, file 3; the broker reads it only when it "
        "creates a queue and refuses to redeclare it changed, and apply leaves the queue as it "
        "is; it has 3 replicas (c1@h, c2@h, c3@h), as asked: nothing to do")
    assert count(changes)["conflict"] == 0 and nothing_to_do(changes)


def test_plan_a_live_queue_short_of_replicas_says_how_to_grow_it_and_is_no_conflict() -> None:
    live = live_of(topology(None), members=("c1@h",), online=NODES)
    changes = diff(topology(3), live)
    orders = next(c for c in changes if c.name == "orders")
    assert orders.kind == "grow"
    assert orders.detail == (
        "1 replica (c1@h), the file asks for 3: add what is missing with rabbitmq-queues "
        "add_member --vhost shop orders c2@h; rabbitmq-queues add_member --vhost shop orders "
        "c3@h (or rabbitmq-queues grow NODE all for every queue short of a replica on NODE); "
        "or leave it: apply does not change a live queue's replicas")
    totals = count(changes)
    assert (totals["grow"], totals["conflict"]) == (3, 0)  # orders, its tier, its parking
    assert nothing_to_do(changes)  # apply has nothing it could do about it
    # The same shortfall with the argument already right (declared while nodes were missing).
    same = live_of(topology(3), members=("c1@h", "c2@h"), online=NODES)
    again = next(c for c in diff(topology(3), same) if c.name == "orders")
    assert again.kind == "grow" and again.detail.startswith(
        "2 replicas (c1@h, c2@h), the file asks for 3: add what is missing with "
        "rabbitmq-queues add_member --vhost shop orders c3@h (")


def test_plan_more_replicas_than_asked_and_replicas_dropped_from_the_file() -> None:
    more = next(c for c in diff(topology(1), live_of(topology(None))) if c.name == "orders")
    assert more.kind == "unchanged" and more.detail.endswith(
        "it has 3 replicas (c1@h, c2@h, c3@h), more than asked: leave it, or remove some with "
        "rabbitmq-queues delete_member")
    dropped = next(c for c in diff(topology(None), live_of(topology(None),
                                                          arguments_from=topology(3)))
                   if c.name == "orders")
    assert dropped.kind == "unchanged"
    assert dropped.detail.startswith("x-quorum-initial-group-size: live 3, file absent; ")
    matching = next(c for c in diff(topology(3), live_of(topology(3))) if c.name == "orders")
    assert (matching.kind, matching.detail) == ("unchanged", "")


def test_plan_replicas_with_another_difference_is_a_migration() -> None:
    # ``migrate`` rebuilds the queue as the file says, replicas included.
    live = live_of(topology(None))
    queue = live.queues["orders.retry.1s"]
    args = dict(queue.arguments, **{"x-message-ttl": 5000})
    live.queues["orders.retry.1s"] = dataclasses.replace(  # type: ignore[index]
        queue, arguments=args)
    tier = next(c for c in diff(topology(3), live) if c.name == "orders.retry.1s")
    assert tier.kind == "migrate"
    assert tier.detail.startswith("x-message-ttl: live 5000, file 1000")


def render(status: Status) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(status_view(status))
    return out.getvalue()
