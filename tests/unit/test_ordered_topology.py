"""An ordered queue in the topology file: what it compiles to (a consistent-hash lanes exchange
the file's bindings feed, lane queues with a single active consumer, a held queue per lane), its
refusals in one line each, and the one line apply says when the broker lacks the plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from rabbit_retry.topology import compile_topology, parse_topology
from rabbit_retry.topology.compile import missing_plugin
from rabbit_retry.topology.load import TopologyError
from rabbit_retry.topology.plan import Exchange
from rabbit_retry.topology.resolved import OrderedConfig, from_values, to_values

REWARDS = """\
version: 1
exchanges:
  rewards: {type: topic}
queues:
  rewards.points:
    queue_type: QTYPE
    bindings: [{exchange: rewards, routing_key: "points.*"}]
    ordered: ORDERED
    retry: {delays: [5s, 1m], max_attempts: 4}
"""


def rewards(ordered: str = "{key: {header: user-id}, lanes: 3}", qtype: str = "quorum") -> str:
    return REWARDS.replace("ORDERED", ordered).replace("QTYPE", qtype)


def test_an_ordered_queue_resolves_with_its_defaults() -> None:
    topology = parse_topology(rewards("{key: routing_key}"))
    assert topology.queue("rewards.points").ordered == OrderedConfig(None, 4, "hold")
    assert from_values(to_values(topology)) == topology  # crosses to the worker intact


@pytest.mark.parametrize("qtype", ["quorum", "classic"])
def test_an_ordered_queue_compiles_to_lanes_fed_by_the_files_bindings(qtype: str) -> None:
    plan = compile_topology(parse_topology(rewards(qtype=qtype)))
    [lanes] = [e for e in plan.exchanges if e.role == "lanes-exchange"]
    assert (lanes.name, lanes.type, dict(lanes.arguments)) == (
        "rewards.points.lanes", "x-consistent-hash", {"hash-header": "user-id"})
    roles = [(q.name, q.role) for q in plan.queues_of("rewards.points")]
    assert roles[:7] == [
        ("rewards.points", "main"),
        ("rewards.points.lane.0", "lane"), ("rewards.points.lane.0.held", "held"),
        ("rewards.points.lane.1", "lane"), ("rewards.points.lane.1.held", "held"),
        ("rewards.points.lane.2", "lane"), ("rewards.points.lane.2.held", "held"),
    ]
    queues = {q.name: q for q in plan.queues}
    main, lane = queues["rewards.points"], queues["rewards.points.lane.1"]
    assert dict(lane.arguments) == {**main.arguments, "x-single-active-consumer": True}
    held = queues["rewards.points.lane.1.held"].arguments
    assert held.get("x-dead-letter-exchange") is None and held.get("x-message-ttl") is None
    assert held["x-queue-type"] == qtype
    feeds = [(b.source, b.destination, b.routing_key, b.destination_type) for b in plan.bindings
             if "rewards.points.lane" in b.destination or b.destination_type == "exchange"]
    assert feeds == [
        ("rewards", "rewards.points.lanes", "points.*", "exchange"),  # nothing binds Q itself
        ("rewards.points.lanes", "rewards.points.lane.0", "1", "queue"),
        ("rewards.points.lanes", "rewards.points.lane.1", "1", "queue"),
        ("rewards.points.lanes", "rewards.points.lane.2", "1", "queue"),
    ]


@pytest.mark.parametrize(("ordered", "message"), [
    ("{key: user-id}", "queues.rewards.points.ordered.key"),
    ("{key: routing_key, lanes: 0}", "queues.rewards.points.ordered.lanes"),
    ("{key: routing_key, lanes: 65}", "queues.rewards.points.ordered.lanes"),
    ("{key: routing_key, on_park: skip}", "queues.rewards.points.ordered.on_park"),
    ("{key: {header: ''}}", "queues.rewards.points.ordered.key"),
    ("{lanes: 2}", "queues.rewards.points.ordered.key"),
])
def test_a_bad_ordered_block_names_its_key(ordered: str, message: str) -> None:
    with pytest.raises(TopologyError) as caught:
        parse_topology(rewards(ordered), "rewards.yml")
    [line] = caught.value.lines
    assert line.startswith(f"rewards.yml:8: {message}:"), line


def test_a_queue_named_like_a_lane_collides() -> None:
    text = rewards("{key: routing_key, lanes: 2}") + "  rewards.points.lane.1.held: {}\n"
    with pytest.raises(TopologyError) as caught:
        parse_topology(text, "rewards.yml")
    assert caught.value.lines == [
        "rewards.yml:10: queues.rewards.points.lane.1.held: queue "
        "'rewards.points.lane.1.held' collides with a lane of ordered queue 'rewards.points'"]


def test_apply_names_the_plugin_an_ordered_queue_needs_in_one_line() -> None:
    plan = compile_topology(parse_topology(rewards()))
    assert missing_plugin(plan, {"direct", "topic", "fanout", "headers"}) == (
        "queue 'rewards.points' is ordered: enable RabbitMQ's consistent-hash exchange on every "
        "node first: rabbitmq-plugins enable rabbitmq_consistent_hash_exchange")
    assert missing_plugin(plan, {"direct", "x-consistent-hash"}) is None
    plain = compile_topology(parse_topology(rewards().replace(
        "    ordered: {key: {header: user-id}, lanes: 3}\n", "")))
    assert missing_plugin(plain, {"direct"}) is None


def test_status_counts_an_ordered_queues_lanes_and_held_keys() -> None:
    from rabbit_retry.broker.inspect import LiveQueue, LiveState
    from rabbit_retry.status import build_status

    plan = compile_topology(parse_topology(rewards()))
    counts = {"rewards.points": (1, 0), "rewards.points.lane.0": (4, 2),
              "rewards.points.lane.2": (0, 3), "rewards.points.retry.5s": (2, 0),
              "rewards.points.parking": (1, 0), "rewards.points.lane.0.held": (6, 0),
              "rewards.points.lane.1.held": (3, 0)}
    queues = {}
    for q in plan.queues:
        ready, unacked = counts.get(q.name, (0, 0))
        queues[q.name] = LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                                   ready + unacked, ready, unacked, 2)
    live = LiveState(queues, {}, ())
    [row] = build_status(plan, live, (), vhost="v", source="t.yml").queues
    document = row.to_json()
    assert (document["ready"], document["unacked"]) == (5, 5)  # Q and its lanes
    # two retrying and one on its way back through Q hold their keys; so does the parked one
    assert (document["held_keys"], document["held_messages"]) == (4, 9)
    [continued] = build_status(plan, live, (), vhost="v", source="t.yml",
                               on_park={"rewards.points": "continue"}).queues
    assert continued.held_keys == 3


def test_more_lanes_is_a_migrate_fewer_only_from_4_3_and_a_change_under_way_is_resumed() -> None:
    from dataclasses import replace

    from rabbit_retry.broker.diff import diff, refusal
    from rabbit_retry.broker.inspect import LiveExchange, LiveQueue, LiveState
    from rabbit_retry.broker.lane_changes import plan_lane_changes
    from rabbit_retry.topology.compile import RING_IN_LANE_ORDER

    def live_of(text: str, *extra: str, marked: bool = True) -> LiveState:
        """The broker after ``apply`` of ``text``: its lanes exchange says its ring is in lane
        order (``apply`` on 4.3 and later) unless ``marked`` is False."""
        plan = compile_topology(parse_topology(text))
        queues = {q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                                    0, 0, 0, 0) for q in plan.queues}
        for name in extra:
            queues[name] = replace(queues["rewards.points"], name=name)
        mark = dict([RING_IN_LANE_ORDER]) if marked else {}
        exchanges = {e.name: LiveExchange(e.name, e.type, True, False, False,
                                          {**e.arguments, **mark})
                     for e in plan.exchanges if e.role == "lanes-exchange"}
        return LiveState(queues, exchanges, plan.bindings)

    four = rewards("{key: {header: user-id}, lanes: 4}")
    eight = rewards("{key: {header: user-id}, lanes: 8}")
    same = diff(compile_topology(parse_topology(four)), live_of(four))
    assert refusal(same, "v", "r.yml") == []  # positive control: nothing changed, no refusal
    eight_plan = compile_topology(parse_topology(eight))
    changed = diff(eight_plan, live_of(four))
    [line, how] = refusal(changed, "v", "r.yml")
    assert line == (
        "queue rewards.points in vhost 'v' differs from the file: ordered with 4 lanes on the "
        "broker, 8 in the file: migrate adds lanes 4-7; a key that moves to a new lane runs "
        "there once its earlier messages in the old lane are done")
    assert "`rabbit-retry migrate r.yml`" in how
    [migrate] = [c.to_json() for c in changed if c.kind == "migrate"]
    assert migrate["lanes"] == {"broker": 4, "file": 8} and migrate["name"] == "rewards.points"
    [change] = plan_lane_changes(changed, eight_plan)
    assert (change.before, change.after, change.marker) == (4, 8, "rewards.points.lanes.4-to-8")
    assert [lane.name for lane in change.lanes] == [f"rewards.points.lane.{n}" for n in range(4, 8)]
    assert [b.destination for b in change.bindings] == [lane.name for lane in change.lanes]
    # fewer lanes: refused before 4.3 (a node restart reorders the ring), a migrate from 4.3
    four_plan = compile_topology(parse_topology(four))
    for version in ("4.0.5", "3.10.8", ""):
        older = replace(live_of(eight), version=version)
        [line, _] = refusal(diff(four_plan, older), "v", "f")
        assert "keep lanes: 8 (a live ordered queue can get fewer lanes on RabbitMQ 4.3 and " \
            "later, not on " in line, line
    # a lane not bound (an apply that stopped midway): binding it later would move keys
    # without a gate, so neither more nor fewer lanes until apply has bound it
    for file_plan in (eight_plan, four_plan):
        gap = replace(live_of(six := rewards("{key: {header: user-id}, lanes: 6}")),
                      version="4.3.6")
        gap = replace(gap, bindings=tuple(b for b in gap.bindings
                                          if b.destination != "rewards.points.lane.2"))
        [line, _] = refusal(diff(file_plan, gap), "v", "f")
        assert "but rewards.points.lane.2 is not bound to rewards.points.lanes once, as apply " \
            "binds each lane (an apply that stopped midway?): run apply with a file of 6 " \
            "lanes first" in line, line
        assert refusal(diff(compile_topology(parse_topology(six)), gap), "v", "f") == []
    # on 4.3 with a lanes exchange declared before lanes were bound in order (or on an older
    # version): its ring is in no known order, refused
    unmarked = replace(live_of(eight, marked=False), version="4.3.6")
    [line, _] = refusal(diff(four_plan, unmarked), "v", "f")
    assert "keep lanes: 8 (its lanes exchange was declared before rabbit-retry bound lanes in " \
        "order, or on RabbitMQ before 4.3" in line, line
    fewer = diff(four_plan, replace(live_of(eight), version="4.3.6"))
    [line, _] = refusal(fewer, "v", "f")
    assert line.endswith("ordered with 8 lanes on the broker, 4 in the file: migrate takes away "
                         "lanes 4-7; their keys go to the remaining lanes and run there once "
                         "their earlier messages in the removed lane are done, and a removed "
                         "lane is deleted once it is"), line
    [removal] = plan_lane_changes(fewer, four_plan)
    assert (removal.before, removal.after, removal.marker) == (8, 4, "rewards.points.lanes.8-to-4")
    # begun: one lane at a time, the last first; a step's marker is there: resumed to the
    # file's 4, also when a run stopped between the next step's marker and deleting its own
    def begun(*markers: str) -> LiveState:
        live = live_of(eight, *(f"rewards.points.lanes.{m}" for m in markers))
        return replace(live, version="4.3.6")

    [again] = plan_lane_changes(diff(four_plan, begun("8-to-7")), four_plan)
    assert (again.before, again.after) == (8, 4)
    seven = rewards("{key: {header: user-id}, lanes: 7}")
    gone = {q: v for q, v in begun("8-to-7", "7-to-6").queues.items()
            if not q.startswith("rewards.points.lane.7")}
    stopped = replace(begun(), queues=gone)
    [again] = plan_lane_changes(diff(four_plan, stopped), four_plan)
    assert (again.before, again.after) == (7, 4)
    [line, _] = refusal(diff(compile_topology(parse_topology(seven)), begun("8-to-7")), "v", "f")
    assert "migrate began taking away lane 7" in line, line
    # a change migrate began (its marker is there, every lane already declared): resumed, and
    # refused with a file of another number of lanes
    begun = live_of(eight, "rewards.points.lanes.4-to-8")
    [resumed] = plan_lane_changes(diff(eight_plan, begun), eight_plan)
    assert (resumed.before, resumed.after) == (4, 8)
    twelve = rewards("{key: {header: user-id}, lanes: 12}")
    [line, _] = refusal(diff(compile_topology(parse_topology(twelve)), begun), "v", "f")
    assert "migrate began taking it from 4 to 8 lanes; the file says 12" in line
    plain = rewards().replace("    ordered: {key: {header: user-id}, lanes: 3}\n", "")
    [line, _] = refusal(diff(compile_topology(parse_topology(four)), live_of(plain)), "v", "f")
    assert "a plain queue on the broker that messages reach directly" in line


def test_apply_marks_a_new_lanes_exchange_in_lane_order_from_4_3_and_ignores_the_mark() -> None:
    """The lanes exchange ``apply`` creates on 4.3 and later carries the argument that says its
    ring is in lane order (``apply`` binds lanes one after another); on older versions, where a
    restart reorders the ring, it does not. A live exchange with or without it is unchanged."""
    from dataclasses import replace

    from rabbit_retry.broker.diff import diff
    from rabbit_retry.broker.inspect import LiveExchange, LiveState
    from rabbit_retry.topology.compile import RING_IN_LANE_ORDER

    plan = compile_topology(parse_topology(rewards()))
    [lanes] = [e for e in plan.exchanges if e.role == "lanes-exchange"]
    for version, marked in (("4.3.6", True), ("4.0.5", False), ("3.10.8", False)):
        [created] = [c.item for c in diff(plan, replace(LiveState.empty(), version=version))
                     if c.name == lanes.name]
        assert isinstance(created, Exchange)
        assert (RING_IN_LANE_ORDER[0] in created.arguments) is marked, version
        assert created.arguments["hash-header"] == "user-id"
    for arguments in (dict(lanes.arguments), {**lanes.arguments, **dict([RING_IN_LANE_ORDER])}):
        live = replace(LiveState.empty(), version="4.3.6", exchanges={
            lanes.name: LiveExchange(lanes.name, lanes.type, True, False, False, arguments)})
        [change] = [c for c in diff(plan, live) if c.name == lanes.name]
        assert change.kind == "unchanged", change


def test_a_change_of_type_of_a_live_ordered_queue_is_refused_at_its_lanes() -> None:
    """``migrate`` rebuilds a queue through a holding queue bound where it was: a lane taken out
    of the lanes exchange and bound again comes back at another place of the ring, and keys
    would run in another lane than their earlier messages. So the lanes and held queues of a
    live ordered queue whose type changes are a conflict (the rest of the queue would migrate:
    the positive control)."""
    from rabbit_retry.broker.diff import diff
    from rabbit_retry.broker.inspect import LiveQueue, LiveState

    classic = compile_topology(parse_topology(rewards(qtype="classic")))
    live = LiveState({q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments),
                                        0, 0, 0, 0) for q in classic.queues}, {},
                     classic.bindings)
    changes = diff(compile_topology(parse_topology(rewards(qtype="quorum"))), live)
    kinds = {c.name: c.kind for c in changes if c.object == "queue"}
    lanes = [n for n in kinds if ".lane." in n]
    assert len(lanes) == 6 and {kinds[n] for n in lanes} == {"conflict"}
    assert kinds["rewards.points"] == "migrate"
    [detail] = {c.detail for c in changes if c.name == "rewards.points.lane.0"}
    assert detail.endswith("an ordered queue's lanes cannot be rebuilt in place without "
                           "breaking its keys' order: declare a new ordered queue and move the "
                           "publishers to it")


@pytest.mark.parametrize("on_park", ["hold", "continue"])
def test_migrate_says_how_many_keys_are_held_before_it_adds_lanes(
    on_park: str, tmp_path: Path
) -> None:
    """A lane passes only once no key it holds is held: ``migrate`` counts them first (as
    ``status`` does), and says how many parked messages hold, which wait for an operator."""
    from dataclasses import replace

    from rabbit_retry.broker.diff import diff
    from rabbit_retry.broker.inspect import LiveQueue, LiveState
    from rabbit_retry.broker.lane_changes import describe, plan_lane_changes
    from rabbit_retry.cli.provision import _held_now

    two = rewards(f"{{key: {{header: user-id}}, lanes: 2, on_park: {on_park}}}")
    four = two.replace("lanes: 2", "lanes: 4")
    plan = compile_topology(parse_topology(two))
    live_queues = {q.name: LiveQueue(q.name, q.queue_type, True, False, dict(q.arguments))
                   for q in plan.queues}
    live = LiveState(live_queues, {}, plan.bindings)
    path = tmp_path / "r.yml"
    path.write_text(four)
    four_plan = compile_topology(parse_topology(four))
    changes = diff(four_plan, live)
    [change] = plan_lane_changes(changes, four_plan)
    on_parks = parse_topology(four).on_park
    assert _held_now(four_plan, live, changes, on_parks, str(path), "v") == {}  # control: none held
    assert not any("held now" in line for line in describe(change))
    counts = {"rewards.points.parking": 2, "rewards.points.retry.5s": 1}
    for name, messages in counts.items():
        live_queues[name] = replace(live_queues[name], messages=messages)
    held = _held_now(four_plan, live, changes, on_parks, str(path), "v")
    if on_park == "continue":  # a parked message holds no key
        assert held == {"rewards.points": (1, 0)}
        assert describe(change, held["rewards.points"])[1] == (
            "  held now      keys held: 1, by parked messages: 0; a lane passes once no key it "
            "holds is held, and keys moving from it wait until then")
        return
    assert held == {"rewards.points": (3, 2)}
    assert describe(change, held["rewards.points"])[1] == (
        "  held now      keys held: 3, by parked messages: 2 (replay or discard those); a lane "
        "passes once no key it holds is held, and keys moving from it wait until then")


def test_apply_binds_an_ordered_queues_lanes_one_after_another_in_lane_order() -> None:
    """Concurrent binds would number the lanes exchange's buckets in whatever order the
    broker finished them; ``apply`` binds a queue's lanes in one operation, in lane order, before
    any other binding (the file's bindings into the lanes exchange among them), and every other
    binding in an operation of its own (counted once each for the progress bar)."""
    import asyncio
    import random

    from rabbit_retry.broker.declare import _bind_operations
    from rabbit_retry.broker.diff import Change

    plan = compile_topology(parse_topology(rewards("{key: routing_key, lanes: 8}")))
    binds = [Change("create", "binding", f"b{n}", "", b) for n, b in enumerate(plan.bindings)]
    random.Random(7).shuffle(binds)
    lanes_first = [b.item.destination for b in binds  # type: ignore[union-attr]
                   if b.item.source == "rewards.points.lanes"]  # type: ignore[union-attr]
    assert lanes_first != sorted(lanes_first)  # positive control: shuffled

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        async def queue_bind(self, queue: str, exchange: str, **_: object) -> None:
            self.calls.append((exchange, queue))

        async def exchange_bind(self, destination: str, source: str, **_: object) -> None:
            self.calls.append((source, destination))

    counted: list[int] = []
    first, then = _bind_operations(binds, counted.append)
    others = [b for b in plan.bindings if b.source != "rewards.points.lanes"]
    assert (len(first), len(then)) == (1, len(others))
    channel = Recorder()
    for _, op in first + then:
        asyncio.run(op(channel))  # type: ignore[arg-type]
        counted.append(1)  # the pool counts each operation once it is done
    assert channel.calls[:8] == [("rewards.points.lanes", f"rewards.points.lane.{n}")
                                 for n in range(8)]  # all lanes, in order, before the rest
    assert ("rewards", "rewards.points.lanes") in channel.calls[8:]  # the file's binding
    assert len(channel.calls) == len(plan.bindings) == sum(counted)
