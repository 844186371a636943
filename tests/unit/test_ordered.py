"""Ordered keys on the in-memory broker: per key the handler sees messages in publish order
through retries, parks, replays, discards, two workers and a crash mid-stream; a held key's later
messages wait in its lane's held queue, not unacked, while other keys flow; a batch never holds
two messages of one key."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from typing import Any

import pytest

from rabbit_retry import Batch, BatchResult, Delivery, Pause, Permanent, RetryConsumer
from rabbit_retry.contract import release_headers
from rabbit_retry.parking.headers import replay_headers
from rabbit_retry.testing import TestBroker, Verdict, amqp, frames
from rabbit_retry.topology import parse_topology

Q = "rewards.points"
PARKING = Q + ".parking"
VERSIONS = ("3.10", "4.0", "4.3")
LANES = 3


def topology(queue_type: str = "quorum", on_park: str = "hold", key: str = "{header: user-id}",
             delays: str = "[5s, 1m]", attempts: int = 4, lanes: int = LANES) -> str:
    return f"""\
version: 1
exchanges:
  rewards: {{type: topic}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: rewards, routing_key: "points.#"}}]
    ordered: {{key: {key}, lanes: {lanes}, on_park: {on_park}}}
    retry: {{delays: {delays}, max_attempts: {attempts}}}
"""


def broker_for(yaml: str, version: str = "4.3") -> TestBroker:
    return TestBroker(parse_topology(yaml, "rewards.yml"), version=version)


class Ledger(RetryConsumer):
    """Applies each user's events; ``plan[(user, seq)]`` says how its attempts go: a number of
    transient failures first, or "park" (Permanent on its first attempt)."""

    queue = Q
    prefetch = 20

    def __init__(self, plan: dict[tuple[str, int], Any] | None = None) -> None:
        self.plan = dict(plan or {})
        self.applied: dict[str, list[int]] = defaultdict(list)
        self.calls: dict[str, list[int]] = defaultdict(list)

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        self.calls[user].append(seq)
        await asyncio.sleep(0)  # let the others interleave
        step = self.plan.get((user, seq), 0)
        if step == "park":
            self.plan[(user, seq)] = 0  # a replay succeeds
            raise Permanent(f"{user}/{seq}: no such account yet")
        if step:
            self.plan[(user, seq)] = step - 1
            raise RuntimeError(f"{user}/{seq}: ledger busy")
        self.applied[user].append(seq)


def publish(broker: TestBroker, user: str, seq: int) -> None:
    broker.publish(json={"seq": seq}, exchange="rewards", routing_key="points.earned",
                   headers={"user-id": user}, message_id=f"{user}-{seq}")


def never_backwards(calls: dict[str, list[int]]) -> None:
    """Per key, no message is handled after a later one of its key was."""
    for user, seqs in calls.items():
        assert seqs == sorted(seqs), (user, seqs)


def held(broker: TestBroker) -> int:
    return sum(len(broker.messages(f"{Q}.lane.{lane}.held")) for lane in range(LANES))


def replay(broker: TestBroker, message_id: str) -> None:
    """What ``parking replay`` does with one parked message: back to ``Q``, then gone."""
    parked = _take_parked(broker, message_id)
    broker.publish(parked.body, queue=Q, headers=replay_headers(parked.headers),
                   message_id=message_id)


def discard(broker: TestBroker, message_id: str) -> None:
    """What ``parking purge`` (and the desk's discard) does with a holder: a release to ``Q``."""
    parked = _take_parked(broker, message_id)
    release = release_headers(parked.headers)
    assert release is not None
    broker.publish(b"", queue=Q, headers=release)


def _take_parked(broker: TestBroker, message_id: str) -> Any:
    [parked] = [m for m in broker.parked(Q) if m.message_id == message_id]
    queue = broker.memory.queue(PARKING)
    queue.ready = [e for e in queue.ready
                   if frames.unmarshal(e.content.header).message_id != message_id]
    return parked


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_each_keys_messages_are_handled_in_publish_order_through_retries(
    version: str, queue_type: str
) -> None:
    rng = random.Random(f"{version}-{queue_type}")
    users = [f"u{i}" for i in range(12)]
    plan = {(u, s): rng.choice([0, 0, 0, 1, 2]) for u in users for s in range(1, 6)}
    ledger = Ledger(plan)
    async with broker_for(topology(queue_type), version) as broker, broker.worker(ledger):
        for seq in range(1, 6):
            for user in users:
                publish(broker, user, seq)
        await broker.settle(retries=True)
        assert held(broker) == 0 and broker.discarded == []
    assert {u: ledger.applied[u] for u in users} == {u: [1, 2, 3, 4, 5] for u in users}
    never_backwards(ledger.calls)
    assert any(n for n in plan.values())  # positive control: there were retries


async def test_the_first_failure_of_a_key_holds_its_later_messages_in_the_held_queue() -> None:
    ledger = Ledger({("alice", 1): 1})
    async with broker_for(topology()) as broker, broker.worker(ledger) as worker:
        for seq in (1, 2, 3):
            publish(broker, "alice", seq)
        first = await broker.settle()
        assert [(d.message_id, d.verdict) for d in first] == [
            ("alice-1", Verdict.RETRIED), ("alice-2", Verdict.HELD), ("alice-3", Verdict.HELD)]
        assert held(broker) == 3  # two messages and the hold; nothing unacked meanwhile
        connection = worker.connection
        assert connection is not None and list(connection.held()) == []
        metrics = worker.runner.metrics.for_queue(Q)
        assert metrics.held()[0] == 1
        rest = await broker.settle(retries=True)
        # (Two channels, Q's and the lane's: their acks may come in either order.)
        assert sorted(d.verdict for d in rest) == sorted(
            [Verdict.FORWARDED, Verdict.ACKED, Verdict.ACKED, Verdict.ACKED])
        assert metrics.held() == (0, 0.0)
    assert ledger.applied["alice"] == [1, 2, 3]


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_parked_message_holds_its_key_until_replayed_then_goes_first(
    queue_type: str,
) -> None:
    ledger = Ledger({("bob", 2): "park"})
    async with broker_for(topology(queue_type)) as broker, broker.worker(ledger):
        for seq in (1, 2, 3, 4):
            publish(broker, "bob", seq)
        await broker.settle(retries=True)
        assert ledger.applied["bob"] == [1]
        [parked] = broker.parked(Q)
        assert parked.headers["ordered-key"] == "bob" and parked.headers["ordered-hold"]
        publish(broker, "bob", 5)  # still held: waits behind the parked one
        await broker.settle(retries=True)
        assert ledger.applied["bob"] == [1]
        replay(broker, "bob-2")
        await broker.settle(retries=True)
        assert held(broker) == 0
    assert ledger.applied["bob"] == [1, 2, 3, 4, 5]
    never_backwards(ledger.calls)


async def test_a_discarded_holder_releases_its_key_and_the_rest_follow() -> None:
    ledger = Ledger({("carol", 1): "park"})
    async with broker_for(topology()) as broker, broker.worker(ledger):
        for seq in (1, 2, 3):
            publish(broker, "carol", seq)
        await broker.settle(retries=True)
        assert ledger.applied["carol"] == []
        discard(broker, "carol-1")
        await broker.settle(retries=True)
        assert held(broker) == 0 and broker.parked(Q) == []
    assert ledger.applied["carol"] == [2, 3]


async def crash_at(broker: TestBroker, monkeypatch: pytest.MonkeyPatch, name: str,
                   instead: Any, stuck: asyncio.Event, user: str,
                   plan: dict[tuple[str, int], Any]) -> None:
    """Three events of ``user``; a worker (``plan``) whose ``OrderedLane.<name>`` is ``instead``
    until that sets ``stuck``, then dies (``crash``); the method is restored."""
    from rabbit_retry.worker.ordered import OrderedLane

    original = getattr(OrderedLane, name)
    for seq in (1, 2, 3):
        publish(broker, user, seq)
    monkeypatch.setattr(OrderedLane, name, instead)
    async with broker.worker(Ledger(plan)) as first:
        await asyncio.wait_for(stuck.wait(), 5)
        await first.crash()
    monkeypatch.setattr(OrderedLane, name, original)


async def test_a_worker_killed_between_a_park_and_its_hold_leaves_two_copies_handled_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The park's copy is confirmed, the worker dies before the hold is written: the message
    comes back and parks again. Replaying both copies handles it once (the first copy's hold
    is not the key's: dropped), then the key's later messages follow."""
    from rabbit_retry.worker.ordered import OrderedLane

    stuck = asyncio.Event()

    async def dies_first(self: OrderedLane, key: str, hold: Any) -> None:
        stuck.set()
        await asyncio.Event().wait()

    async with broker_for(topology()) as broker:
        await crash_at(broker, monkeypatch, "record", dies_first, stuck, "dan",
                       {("dan", 1): "park"})
        ledger = Ledger({("dan", 1): "park"})
        async with broker.worker(ledger):
            await broker.settle(retries=True)
            copies = broker.parked(Q)
            assert [c.message_id for c in copies] == ["dan-1", "dan-1"]
            assert len({c.headers["ordered-hold"] for c in copies}) == 2
            assert ledger.applied["dan"] == [] and held(broker) == 3
            broker.memory.queue(PARKING).ready = []
            for copy in copies:
                broker.publish(copy.body, queue=Q, headers=replay_headers(copy.headers),
                               message_id=copy.message_id)
            await broker.settle(retries=True)
            assert held(broker) == 0 and broker.parked(Q) == []
    assert ledger.applied["dan"] == [1, 2, 3]
    assert ledger.calls["dan"] == [1, 1, 2, 3]


@pytest.mark.parametrize("on_park", ["retry", "park"])
async def test_a_delivery_back_from_a_crash_after_its_copy_and_hold_were_written_is_not_run_again(
    monkeypatch: pytest.MonkeyPatch, on_park: str,
) -> None:
    """The worker dies after the copy (to a tier, or parked) and its hold were written, before
    the broker took the ack: the delivery comes back, and its key is held by its own copy. It is
    acked, not moved behind that copy to run a second time once the copy has."""
    from rabbit_retry.worker.ordered import OrderedLane

    after_copy, stuck = OrderedLane.after_copy, asyncio.Event()

    async def dies_after(self: OrderedLane, turn: Any, hold: Any) -> None:
        await after_copy(self, turn, hold)  # the hold is written
        stuck.set()
        await asyncio.Event().wait()

    step = "park" if on_park == "park" else 1
    async with broker_for(topology()) as broker:
        await crash_at(broker, monkeypatch, "after_copy", dies_after, stuck, "eve",
                       {("eve", 1): step})
        ledger = Ledger()
        async with broker.worker(ledger):
            await broker.settle(retries=True)
            if on_park == "park":
                assert ledger.calls["eve"] == []  # held by the parked copy
                replay(broker, "eve-1")
                await broker.settle(retries=True)
            assert held(broker) == 0 and broker.parked(Q) == []
    assert ledger.applied["eve"] == [1, 2, 3]
    assert ledger.calls["eve"] == [1, 2, 3]  # eve-1 once: its copy


async def test_a_delivery_back_from_a_crash_after_it_was_moved_to_the_held_queue_runs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker dies after moving a held key's message to the held queue, before the broker
    took its ack: the delivery comes back while its copy waits there as the key's last. It is
    acked, not moved a second time (both copies would run, one after the other)."""
    from rabbit_retry.worker.ordered import OrderedLane

    write, stuck = OrderedLane._write, asyncio.Event()

    async def dies_after_moving(self: OrderedLane, body: bytes, properties: Any,
                                alive: Any) -> None:
        await write(self, body, properties, alive)
        if properties.message_id == "hal-2":
            stuck.set()
            await asyncio.Event().wait()

    async with broker_for(topology()) as broker:
        await crash_at(broker, monkeypatch, "_write", dies_after_moving, stuck, "hal",
                       {("hal", 1): 1})
        ledger = Ledger()
        async with broker.worker(ledger):
            await broker.settle(retries=True)
            assert held(broker) == 0
    assert ledger.applied["hal"] == [1, 2, 3]
    assert ledger.calls["hal"] == [1, 2, 3]


async def test_a_holder_forwarded_twice_runs_once() -> None:
    """A retried message's copy reaches its lane twice (``Q``'s forward written, its ack lost
    with a connection): the second copy, arriving while the first waits or runs, is dropped."""
    import dataclasses

    release, started = asyncio.Event(), []

    class Slow(Ledger):
        async def handle(self, delivery: Delivery) -> None:
            started.append((delivery.payload["seq"], delivery.attempt))
            if delivery.attempt == 2:
                await release.wait()
            await super().handle(delivery)

    ledger = Slow({("gil", 1): 1})
    async with broker_for(topology()) as broker, broker.worker(ledger):
        for seq in (1, 2, 3):
            publish(broker, "gil", seq)
        await broker.settle()  # gil-1 waits in its tier, 2 and 3 in the held queue
        tier = broker.memory.queue(f"{Q}.retry.5s")
        [copy] = tier.ready
        tier.ready.append(dataclasses.replace(copy, seq=copy.seq + 1))
        due = broker.memory.next_expiry()
        assert due is not None
        broker.memory.expire(due)
        lanes = [broker.memory.queue(f"{Q}.lane.{n}") for n in range(LANES)]
        await broker.wait_for(lambda: started == [(1, 1), (1, 2)]
                              and not any(map(len, lanes)) and not broker.memory.queue(Q),
                              what="the first copy running, the second gone")
        release.set()
        await broker.settle(retries=True)
        assert held(broker) == 0
    assert started == [(1, 1), (1, 2), (2, 1), (3, 1)]
    assert ledger.applied["gil"] == [1, 2, 3]


async def test_on_park_continue_lets_the_key_move_on() -> None:
    ledger = Ledger({("dan", 1): "park"})
    async with broker_for(topology(on_park="continue")) as broker, broker.worker(ledger):
        for seq in (1, 2, 3):
            publish(broker, "dan", seq)
        await broker.settle(retries=True)
        [parked] = broker.parked(Q)
        assert "ordered-hold" not in parked.headers
    assert ledger.applied["dan"] == [2, 3]


async def test_other_keys_flow_while_one_is_held() -> None:
    ledger = Ledger({("held", 1): "park"})
    async with broker_for(topology()) as broker, broker.worker(ledger) as worker:
        publish(broker, "held", 1)
        await broker.settle()
        for seq in range(2, 7):
            publish(broker, "held", seq)
        others = [f"o{i}" for i in range(40)]
        for seq in range(1, 6):
            for user in others:
                publish(broker, user, seq)
        decisions = await broker.settle()
        by_verdict = Counter(d.verdict for d in decisions)
        assert by_verdict == {Verdict.ACKED: 200, Verdict.HELD: 5}
        connection = worker.connection
        assert connection is not None and list(connection.held()) == []  # nothing unacked
        assert held(broker) == 6  # the held key's five and its hold
    assert all(ledger.applied[u] == [1, 2, 3, 4, 5] for u in others)
    assert ledger.applied["held"] == []


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_crash_mid_stream_and_a_second_worker_keep_every_keys_order(
    version: str,
) -> None:
    rng = random.Random(version)
    users = [f"u{i}" for i in range(8)]
    plan = {(u, s): rng.choice([0, 0, 1]) for u in users for s in range(1, 9)}
    first, second = Ledger(plan), Ledger(plan)
    calls: dict[str, list[int]] = defaultdict(list)
    async with broker_for(topology(), version) as broker:
        async with broker.worker(first) as one, broker.worker(second):
            for seq in range(1, 5):
                for user in users:
                    publish(broker, user, seq)
            await broker.settle()
            await one.crash()  # its lanes move to the second worker, held keys and all
            for seq in range(5, 9):
                for user in users:
                    publish(broker, user, seq)
            await broker.settle(retries=True)
        assert held(broker) == 0 and broker.discarded == []
    for ledger in (first, second):
        for user, seqs in ledger.calls.items():
            calls[user] += seqs
    applied = {u: sorted(set(first.applied[u]) | set(second.applied[u])) for u in users}
    assert applied == {u: list(range(1, 9)) for u in users}
    assert sum(len(first.applied[u]) for u in users) > 0  # the first did work before it died
    assert sum(len(second.applied[u]) for u in users) > 0
    for user in users:  # each worker saw each key's messages in order
        assert first.calls[user] == sorted(first.calls[user])
        assert second.calls[user] == sorted(second.calls[user])
        # ... and the second never went back before what the first handled
        handled_by_first = max(first.applied[user], default=0)
        assert all(s >= handled_by_first for s in second.calls[user]), (user, calls[user])


@pytest.mark.parametrize("count_lags", [False, True])
async def test_a_key_held_when_its_worker_dies_stays_held_for_the_next(
    count_lags: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``count_lags`` the broker counts the held queue empty as the new worker takes the
    lane over: a quorum queue counts what it has applied, and the entries a dead owner had
    taken come back with a command applied after the lane moved on (the new owner's takes
    queue behind it). The new owner must find eve held all the same."""
    ledger = Ledger({("eve", 1): 1})
    async with broker_for(topology()) as broker:
        async with broker.worker(ledger) as worker:
            for seq in (1, 2, 3):
                publish(broker, "eve", seq)
            await broker.settle()
            await worker.crash()
        assert held(broker) == 3
        if count_lags:
            declare = amqp.Channel.queue_declare

            async def lagging(self: amqp.Channel, queue: str = "", **kwargs: Any) -> Any:
                declared = await declare(self, queue, **kwargs)
                if queue.endswith(".held"):
                    declared.message_count = 0
                return declared

            monkeypatch.setattr(amqp.Channel, "queue_declare", lagging)
        async with broker.worker(ledger):
            publish(broker, "eve", 4)  # the new worker learns eve is held from the held queue
            decisions = await broker.settle()
            # Taking the lane over, it read the held queue (eve-2 and 3 written back as they
            # were) and moved eve-4 behind them: nothing of eve ran.
            assert sorted((d.message_id, d.verdict) for d in decisions) == [
                ("eve-2", Verdict.HELD), ("eve-3", Verdict.HELD), ("eve-4", Verdict.HELD)]
            assert ledger.calls["eve"] == [1]
            await broker.settle(retries=True)
    assert ledger.applied["eve"] == [1, 2, 3, 4]
    never_backwards(ledger.calls)


@pytest.mark.parametrize(("value", "lane"), [
    (f"1/{LANES}", 1), (f"0/{LANES}", 0), (f"{LANES - 1}/{LANES}", LANES - 1),
    (f"1/{LANES}".encode(), 1),  # a client that sends strings as bytes
    (f"{LANES}/{LANES}", None), (f"-1/{LANES}", None),  # not a lane of the queue
    (f"1/{LANES - 1}", 1), (f"1/{LANES + 1}", 1),  # written with another number of lanes
    # written on a lane this worker's file does not give yet (migrate added it): that lane
    (f"{LANES}/{LANES + 2}", LANES), (f"{LANES + 1}/{LANES + 2}", LANES + 1),
    (f"{LANES + 2}/{LANES + 2}", None),
    ("1", None), (1, None), (True, None), ("x/3", None), (None, None),
])
def test_only_a_lane_of_the_queue_is_taken_from_a_copy(value: object, lane: int | None) -> None:
    from rabbit_retry.contract import ORDERED_LANE
    from rabbit_retry.worker.ordering import holding_lane

    assert holding_lane({ORDERED_LANE: value} if value is not None else {}, LANES) == lane


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_holder_comes_back_to_its_lane_when_the_lanes_ring_changes(version: str) -> None:
    """RabbitMQ before 4.3 rebuilds the lanes exchange's consistent-hash ring in another order
    when a node restarts (docs/versions.md): a held key's copy, back from its tier, must still
    reach the lane whose held queue holds the key, or the key stays held and the copy is taken
    for a stale one."""
    ledger = Ledger({("alice", 1): 1})
    async with broker_for(topology(), version) as broker, broker.worker(ledger):
        for seq in (1, 2, 3):
            publish(broker, "alice", seq)
        await broker.settle()
        [lane] = [n for n in range(LANES) if broker.messages(f"{Q}.lane.{n}.held")]
        ring = broker.memory.bindings[f"{Q}.lanes"]
        ring.append(ring.pop(0))  # every bucket to another lane, as a restart may do
        assert ring[lane].queue != f"{Q}.lane.{lane}"  # positive control: alice's bucket moved
        await broker.settle(retries=True)
        assert held(broker) == 0 and broker.discarded == []
    assert ledger.applied["alice"] == [1, 2, 3]
    never_backwards(ledger.calls)


async def test_a_worker_on_the_old_file_sends_a_holder_back_to_a_lane_migrate_added() -> None:
    """Rolling restart after ``migrate`` added lane 3: a worker still on the 3-lane file takes a
    holding copy written on lane 3 (``3/4``) straight back there, not through the ring (which a
    node restart before 4.3 may have reshuffled). A copy naming a lane the broker does not have
    (the queue made again with fewer) goes through the ring instead of waiting unroutable."""
    from rabbit_retry.contract import ORDERED_KEY, ORDERED_LANE

    async with broker_for(topology(lanes=LANES + 1)) as broker:
        broker.topology = parse_topology(topology(), "rewards.yml")  # the worker's old file
        lanes = broker.memory.exchanges[f"{Q}.lanes"]
        ring = {u: broker.memory.route(lanes, "", {"user-id": u})[0].name
                for u in (f"u{i}" for i in range(50))}
        user = next(u for u in ring if ring[u] != f"{Q}.lane.{LANES}")  # the ring: elsewhere
        ledger = Ledger()
        async with broker.worker(ledger):
            for seq, mark in ((1, f"{LANES}/{LANES + 1}"), (2, f"{LANES + 2}/{LANES + 3}")):
                broker.publish(json={"seq": seq}, queue=Q, message_id=f"{user}-{seq}",
                               headers={"user-id": user, ORDERED_KEY: user, ORDERED_LANE: mark})
                await broker.settle()
            [copy] = broker.messages(f"{Q}.lane.{LANES}")  # no consumer on the old file
            assert copy.message_id == f"{user}-1"
            assert broker.messages(Q) == []
    assert ledger.applied == {user: [2]}  # the second, through the ring to a lane here


async def test_a_key_released_while_a_pass_hands_back_another_leaves_its_lane_tidy() -> None:
    """bob's holder is done and a pass hands bob's waiting messages back; alice's holder, in the
    same lane, is done meanwhile. Her hold and release say nothing any more, and once bob's are
    handed back nothing else comes to the lane: the pass must take them away itself."""
    entered, gate = asyncio.Event(), asyncio.Event()

    class Slow(Ledger):
        async def handle(self, delivery: Delivery) -> None:
            if (delivery.headers["user-id"], delivery.payload["seq"]) == (bob, 2):
                entered.set()
                await gate.wait()
            await super().handle(delivery)

    async with broker_for(topology()) as broker:
        lanes = broker.memory.exchanges[f"{Q}.lanes"]
        lane = {u: broker.memory.route(lanes, "", {"user-id": u})[0].name
                for u in ("alice", *(f"u{i}" for i in range(50)))}
        bob = next(u for u in lane if u != "alice" and lane[u] == lane["alice"])
        ledger = Slow({("alice", 1): 2, (bob, 1): 1})
        async with broker.worker(ledger):
            publish(broker, "alice", 1)
            for seq in (1, 2, 3, 4):
                publish(broker, bob, seq)
            await broker.settle()  # both keys held, bob's later three in the held queue
            assert held(broker) == 5
            for step in ("5s: alice fails again, bob's first done", "1m: alice's holder done"):
                due = broker.memory.next_expiry()
                assert due is not None, step
                broker.memory.expire(due)
                await asyncio.wait_for(entered.wait(), 5)  # bob's second runs, and waits
            for _ in range(500):
                if ledger.applied["alice"]:
                    break
                await asyncio.sleep(0.01)
            assert ledger.applied["alice"] == [1]
            gate.set()
            await broker.settle()
            assert held(broker) == 0 and broker.discarded == []
    assert ledger.applied[bob] == [1, 2, 3, 4]
    never_backwards(ledger.calls)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_deliveries_whose_acks_the_broker_lost_are_not_handled_again(
    monkeypatch: pytest.MonkeyPatch, queue_type: str,
) -> None:
    """A broker that restarts can lose acks the worker wrote: it hands those deliveries back
    after their key's later messages ran (seen on 3.10 under load). The worker remembers what
    it settled: they are acked again, not handled again, and the key goes on in order."""
    from rabbit_retry.testing.amqp import Channel

    ack, lost = Channel.basic_ack, []

    async def lose(self: Channel, delivery_tag: int, multiple: bool = False,
                   wait: bool = True) -> None:
        lost.append(delivery_tag)

    ledger = Ledger({("erin", 2): 1})
    async with broker_for(topology(queue_type)) as broker, broker.worker(ledger) as worker:
        monkeypatch.setattr(Channel, "basic_ack", lose)
        for seq in (1, 2, 3):
            publish(broker, "erin", seq)
        await broker.wait_for(lambda: ledger.calls["erin"] == [1, 2])  # erin-2 to its tier
        due = broker.memory.next_expiry()
        assert due is not None
        broker.memory.expire(due)
        await broker.wait_for(lambda: ledger.applied["erin"] == [1, 2, 3])
        assert lost  # the broker has none of the acks (the harness cannot settle: it waits)
        monkeypatch.setattr(Channel, "basic_ack", ack)
        broker.disconnect()  # and goes away: it hands back what it holds unacked
        publish(broker, "erin", 4)
        await broker.settle(retries=True)
        assert len(worker.connections) == 2 and held(broker) == 0
        assert all(not broker.messages(f"{Q}.lane.{n}") for n in range(LANES))
    assert ledger.calls["erin"] == [1, 2, 2, 3, 4], ledger.calls  # erin-2: failed, then ran


async def test_a_delivery_acked_again_keeps_its_keys_next_message_until_the_broker_took_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deliveries handed back after a broker lost their acks are acked again, not run again;
    the key's next message then runs only once those acks are sent and taken, as after any
    delivery of its key. Before, it ran with them still waiting in their run: a kill -9 then
    would hand them back to a worker that no longer remembers them, after the next one ran."""
    from rabbit_retry.testing.amqp import Channel
    from rabbit_retry.worker import settle

    ack = Channel.basic_ack
    unacked_as_three_ran: list[str] = []

    async def lose(self: Channel, delivery_tag: int, multiple: bool = False,
                   wait: bool = True) -> None:
        pass

    class Probe(Ledger):
        ack_run = 100

        async def handle(self, delivery: Delivery) -> None:
            if delivery.payload["seq"] == 3:
                unacked_as_three_ran.extend(m for m in unacked() if m != "erin-3")
            await super().handle(delivery)

    def unacked() -> list[str]:
        assert worker.connection is not None
        return sorted(h.message.header.properties.message_id or ""
                      for h in worker.connection.held())

    ledger = Probe()
    async with broker_for(topology()) as broker, broker.worker(ledger) as worker:
        monkeypatch.setattr(Channel, "basic_ack", lose)
        for seq in (1, 2):
            publish(broker, "erin", seq)
        await broker.wait_for(lambda: ledger.applied["erin"] == [1, 2])
        monkeypatch.setattr(Channel, "basic_ack", ack)
        monkeypatch.setattr(settle, "LINGER_S", 30.0)  # runs go out only when something asks
        monkeypatch.setattr(settle, "STRAGGLER_S", 30.0)
        broker.disconnect()  # the broker hands both back: each is acked again, in a run
        await broker.wait_for(lambda: len(worker.connections) == 2
                              and unacked() == ["erin-1", "erin-2"], what="both back")
        await asyncio.sleep(0.05)
        assert unacked() == ["erin-1", "erin-2"]  # positive control: their acks wait
        publish(broker, "erin", 3)
        await broker.wait_for(lambda: ledger.applied["erin"] == [1, 2, 3])
    assert ledger.calls["erin"] == [1, 2, 3]
    assert unacked_as_three_ran == [], unacked_as_three_ran


async def test_a_keys_next_message_runs_only_once_the_broker_has_taken_the_ack_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key's message that arrives after the one before it finished, while that one's ack
    still waits in a run, runs only once that ack is sent and a round trip on the lane's
    channel was answered after it (the broker takes a channel's frames in order): a crash in
    between must not hand the earlier one back to run after the later (seen on 3.10 with a kill
    -9, first with the ack waiting in its run, then with it written and not yet taken)."""
    from rabbit_retry.testing.amqp import Channel
    from rabbit_retry.worker import settle

    monkeypatch.setattr(settle, "LINGER_S", 30.0)  # runs go out only when something asks
    monkeypatch.setattr(settle, "STRAGGLER_S", 30.0)
    unacked_as_two_ran: list[str] = []
    frames: list[str] = []  # what the lanes' channels sent, in order
    ack, declare = Channel.basic_ack, Channel.queue_declare

    async def acking(self: Channel, delivery_tag: int, multiple: bool = False,
                     wait: bool = True) -> None:
        frames.append("ack")
        await ack(self, delivery_tag, multiple, wait)

    async def declaring(self: Channel, queue: str = "", **kwargs: Any) -> Any:
        answer = await declare(self, queue, **kwargs)
        if kwargs.get("passive") and ".lane." in queue:
            frames.append("round trip")
        return answer

    monkeypatch.setattr(Channel, "basic_ack", acking)
    monkeypatch.setattr(Channel, "queue_declare", declaring)
    frames_as_two_ran: list[str] = []

    class Probe(Ledger):
        ack_run = 100

        async def handle(self, delivery: Delivery) -> None:
            if delivery.payload["seq"] == 2:
                unacked_as_two_ran.extend(unacked())
                frames_as_two_ran.extend(frames)
            await super().handle(delivery)

    def unacked() -> list[str]:
        assert worker.connection is not None
        return [h.message.header.properties.message_id or "" for h in worker.connection.held()]

    ledger = Probe()
    async with broker_for(topology()) as broker, broker.worker(ledger) as worker:
        publish(broker, "erin", 1)
        await broker.wait_for(lambda: ledger.applied["erin"] == [1])
        await asyncio.sleep(0.05)
        assert unacked() == ["erin-1"]  # positive control: its ack waits in the run
        frames.clear()
        publish(broker, "erin", 2)
        await broker.wait_for(lambda: ledger.applied["erin"] == [1, 2])
    assert "erin-1" not in unacked_as_two_ran, unacked_as_two_ran
    assert frames_as_two_ran[-2:] == ["ack", "round trip"], frames_as_two_ran


async def test_a_keys_next_message_waits_until_its_holders_release_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retried message's copy is handled, and its release is being written to the held
    queue when the key's next message arrives: that one waits for the holder to leave. Before,
    it ran at once (the key was already out of ``holds``); a crash before the release was
    confirmed then ran the holder again, after it. Fails without the change (alice-2 handled
    by the first worker, alice-1 again by the second)."""
    from rabbit_retry.worker.ordered import OrderedLane

    write_entry, admit = OrderedLane._write_entry, OrderedLane.admit
    releasing = asyncio.Event()
    admitted: list[str | None] = []

    async def never_confirmed(self: OrderedLane, entry: Any) -> None:
        if entry.kind == "release":
            releasing.set()
            await asyncio.Event().wait()  # the worker dies first
        await write_entry(self, entry)

    async def admitting(self: OrderedLane, task: Any, message: Any, *args: Any) -> Any:
        admitted.append(message.header.properties.message_id)
        return await admit(self, task, message, *args)

    first, second = Ledger({("alice", 1): 1}), Ledger()
    async with broker_for(topology()) as broker:
        async with broker.worker(first) as worker:
            publish(broker, "alice", 1)
            await broker.settle()  # alice-1 failed: its copy waits in a tier, alice is held
            monkeypatch.setattr(OrderedLane, "_write_entry", never_confirmed)
            monkeypatch.setattr(OrderedLane, "admit", admitting)
            due = broker.memory.next_expiry()
            assert due is not None
            broker.memory.expire(due)  # the copy comes back and is handled
            await asyncio.wait_for(releasing.wait(), 5)
            publish(broker, "alice", 2)
            await broker.wait_for(lambda: "alice-2" in admitted, what="alice-2 admitted")
            for _ in range(200):  # room to run, had it been let through
                await asyncio.sleep(0)
            assert first.calls["alice"] == [1, 1]
            await worker.crash()
        monkeypatch.undo()
        async with broker.worker(second):
            await broker.settle(retries=True)
    assert first.calls["alice"] + second.calls["alice"] == [1, 1, 1, 2]


async def test_a_holder_runs_once_the_ack_of_the_delivery_it_retries_was_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry's copy back before the failed delivery's ack left its run (behind a delivery
    still running): the copy runs once that ack is sent and taken. Before, it ran at once and
    its own ack took the key's place in what its next message waits for, so the failed
    delivery's ack could still be unsent when its key's next message ran; a crash then ran the
    failed one again after it. Fails without the change (alice: 1, 1, 2, then 1)."""
    from rabbit_retry.worker import settle

    monkeypatch.setattr(settle, "LINGER_S", 30.0)  # runs go out only when something asks
    monkeypatch.setattr(settle, "STRAGGLER_S", 30.0)

    class Stuck(Ledger):
        ack_run = 100

        async def handle(self, delivery: Delivery) -> None:
            if delivery.headers["user-id"] == "bob":
                self.calls["bob"].append(delivery.payload["seq"])
                await asyncio.Event().wait()  # its tag stays open at the head of the run
            await super().handle(delivery)

    first, second = Stuck({("alice", 1): 1}), Ledger()
    async with broker_for(topology(lanes=1)) as broker:
        async with broker.worker(first) as worker:
            publish(broker, "bob", 1)
            await broker.wait_for(lambda: first.calls["bob"] == [1], what="bob-1 running")
            publish(broker, "alice", 1)
            await broker.wait_for(lambda: broker.memory.next_expiry() is not None,
                                  what="alice-1's copy in its tier")
            broker.memory.expire(broker.memory.next_expiry())  # type: ignore[arg-type]
            await broker.wait_for(lambda: first.applied["alice"] == [1], what="the holder")
            publish(broker, "alice", 2)
            await broker.wait_for(lambda: first.applied["alice"] == [1, 2], what="alice-2")
            await worker.crash()
        monkeypatch.undo()
        async with broker.worker(second):
            await broker.settle(retries=True)
    never_backwards({"alice": first.calls["alice"] + second.calls["alice"]})
    assert second.applied["bob"] == [1]


async def test_routing_key_keys_keep_their_order_too() -> None:
    class ByRoute(Ledger):
        async def handle(self, delivery: Delivery) -> None:
            delivery.headers = {"user-id": delivery.routing_key}
            await super().handle(delivery)

    ledger = ByRoute({("points.u1", 1): 2})
    async with broker_for(topology(key="routing_key")) as broker, broker.worker(ledger):
        for seq in (1, 2, 3):
            for user in ("u1", "u2"):
                broker.publish(json={"seq": seq}, exchange="rewards",
                               routing_key=f"points.{user}", message_id=f"{user}-{seq}")
        await broker.settle(retries=True)
    assert dict(ledger.applied) == {"points.u1": [1, 2, 3], "points.u2": [1, 2, 3]}
    never_backwards(ledger.calls)


async def test_a_batch_never_holds_two_messages_of_one_key() -> None:
    class Batched(RetryConsumer):
        queue = Q
        batch = Batch(size=50, wait=0.02)

        def __init__(self) -> None:
            self.batches: list[list[tuple[str, int]]] = []

        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.headers["user-id"], d.payload["seq"]) for d in deliveries])
            failed = {d: RuntimeError("busy") for d in deliveries
                      if d.payload["seq"] == 2 and d.attempt == 1}
            return BatchResult(failed=failed)

    consumer = Batched()
    async with broker_for(topology()) as broker, broker.worker(consumer):
        for seq in range(1, 5):
            for user in ("a", "b", "c", "d"):
                publish(broker, user, seq)
        await broker.settle(retries=True)
    for batch in consumer.batches:
        users = [user for user, _ in batch]
        assert len(users) == len(set(users)), batch
    seen: dict[str, list[int]] = defaultdict(list)
    for batch in consumer.batches:
        for user, seq in batch:
            seen[user].append(seq)
    assert {u: s for u, s in seen.items()} == {u: [1, 2, 2, 3, 4] for u in "abcd"}
    assert any(len(b) > 1 for b in consumer.batches)  # positive control: keys did share


async def test_a_graceful_stop_hands_a_lane_over_only_after_its_running_handler() -> None:
    """Stopping, a worker keeps its lanes' consumers (cancelled, the broker would hand a lane
    to the other worker at once, and the key's next message would run beside its last)."""
    release = asyncio.Event()
    order: list[str] = []

    class Slow(Ledger):
        async def handle(self, delivery: Delivery) -> None:
            order.append(f"start {delivery.message_id}")
            if delivery.message_id == "fay-1":
                await release.wait()
            order.append(f"end {delivery.message_id}")

    async with broker_for(topology()) as broker, \
            broker.worker(Slow(), grace=10) as first, broker.worker(Slow()):
        publish(broker, "fay", 1)
        await broker.wait_for(lambda: order == ["start fay-1"], what="fay-1 running")
        stopping = asyncio.create_task(first.stop())
        await asyncio.sleep(0.05)
        publish(broker, "fay", 2)
        await asyncio.sleep(0.05)
        assert order == ["start fay-1"]  # fay-2 waits for fay-1, on neither worker
        release.set()
        await stopping
        await broker.settle()
    assert order == ["start fay-1", "end fay-1", "start fay-2", "end fay-2"]


class LedgerDown(ConnectionError):
    pass


class Gateway(Ledger):
    """A ledger behind a downstream that is down until ``up``; its consumer pauses on that."""

    pause = Pause(after=3, on=(LedgerDown,), probe_every=0.01)
    prefetch = 4

    def __init__(self) -> None:
        super().__init__()
        self.up = False
        self.attempts: dict[str, int] = {}  # per message: the attempt it was handled at
        self.running = self.peak = 0  # handler calls at once: now, and the most since reset

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        self.calls[user].append(seq)
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        if not self.up:
            raise LedgerDown("ledger service unreachable")
        self.attempts[f"{user}-{seq}"] = delivery.attempt
        self.applied[user].append(seq)


async def _outage(broker: TestBroker, ledger: Gateway | BatchGateway, users: list[str],
                  long_waits: bool, reconnect: bool = False) -> None:
    """Four messages per user published while the ledger is down; once the pause has probed
    a while, the ledger comes back. Every key's messages are applied in order, none parks,
    and only the three failures that tripped the pause were charged (retried once each)."""
    async with broker.worker(ledger) as worker:
        for seq in range(1, 5):
            for user in users:
                publish(broker, user, seq)
        metrics = worker.runner.metrics.for_queue(Q)

        def sent_back() -> list[Any]:
            return [d for d in broker.decisions if d.verdict == Verdict.SENT_BACK]

        def calls() -> int:
            return sum(map(len, ledger.calls.values()))

        await broker.wait_for(lambda: metrics.paused and calls() >= 3 + 20,
                              what="a pause and twenty failed probes")
        assert metrics.pauses == 1
        connection = worker.connection
        assert connection is not None and list(connection.held())  # waiting, unstarted
        copies = [d.copy for d in sent_back()]
        assert copies and all(c is not None and c.headers["ordered-hold"] for c in copies)
        if long_waits:  # sent back the deliveries that waited past PAUSED_WAIT too
            await broker.wait_for(lambda: len(sent_back()) > calls() - 3,
                                  what="a delivery sent back unstarted")
        else:  # each copy sent back is a watched failure while paused: nothing churns
            assert len(sent_back()) <= calls() - 3
        if reconnect:  # the deliveries waiting come back; the new session stays paused
            assert isinstance(ledger, Gateway)
            broker.disconnect()
            await broker.wait_for(lambda: len(worker.connections) == 2, what="a reconnect")
            before, ledger.peak = calls(), 0
            await broker.wait_for(lambda: calls() >= before + 10, what="probes after it")
            assert metrics.paused and metrics.pauses == 1
            assert ledger.peak == 1  # probes, one at a time: the lanes are paused again
        ledger.up = True
        await broker.wait_for(lambda: not metrics.paused, what="a probe's success")
        await broker.settle(retries=True)
        assert held(broker) == 0 and broker.parked(Q) == [] and broker.discarded == []
    never_backwards(ledger.calls)
    assert sorted(ledger.attempts.values()) == [1] * (len(users) * 4 - 3) + [2] * 3
    assert {u: ledger.applied[u] for u in users} == {u: [1, 2, 3, 4] for u in users}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_pause_on_an_ordered_queue_charges_only_its_trip_and_keeps_every_keys_order(
    version: str, queue_type: str
) -> None:
    """The lanes keep their consumers: what has not started waits (unacked) for a probe, one at
    a time; a watched failure while paused is sent back as a copy that holds its key."""
    async with broker_for(topology(queue_type, delays="[1s]", attempts=3), version) as broker:
        await _outage(broker, Gateway(), [f"u{i}" for i in range(9)], long_waits=False)


async def test_a_delivery_waiting_long_on_a_paused_ordered_queue_is_sent_back_holding_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``PAUSED_WAIT`` (here 0.05 s) a waiting delivery goes back to ``Q`` unstarted,
    holding its key, and waits again as that copy: nothing stays unacked for the whole outage
    (the broker closes a channel whose delivery it waits on past its consumer timeout)."""
    from rabbit_retry.worker import lane

    monkeypatch.setattr(lane, "PAUSED_WAIT", 0.05)
    async with broker_for(topology(delays="[1s]", attempts=3)) as broker:
        await _outage(broker, Gateway(), [f"u{i}" for i in range(9)], long_waits=True)


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_pause_on_an_ordered_queue_outlives_a_reconnect(version: str) -> None:
    async with broker_for(topology(delays="[1s]", attempts=3), version) as broker:
        await _outage(broker, Gateway(), [f"u{i}" for i in range(9)], long_waits=False,
                      reconnect=True)


class BatchGateway(RetryConsumer):
    """``Gateway`` as a batch consumer: a batch fails whole while the ledger is down."""

    queue = Q
    batch = Batch(size=4, wait=0.01)
    pause = Gateway.pause

    def __init__(self) -> None:
        self.up = False
        self.applied: dict[str, list[int]] = defaultdict(list)
        self.calls: dict[str, list[int]] = defaultdict(list)
        self.attempts: dict[str, int] = {}

    async def handle_batch(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self.calls[delivery.headers["user-id"]].append(delivery.payload["seq"])
        await asyncio.sleep(0)
        if not self.up:
            raise LedgerDown("ledger service unreachable")
        for delivery in deliveries:
            user, seq = delivery.headers["user-id"], delivery.payload["seq"]
            self.attempts[f"{user}-{seq}"] = delivery.attempt
            self.applied[user].append(seq)


async def test_a_batch_consumer_pauses_an_ordered_queue_the_same_way() -> None:
    """Each delivery of a failed batch counts towards the pause on its own: the first three
    failures trip it and are charged, the batch's fourth and every later one are sent back."""
    async with broker_for(topology(delays="[1s]", attempts=3)) as broker:
        await _outage(broker, BatchGateway(), [f"u{i}" for i in range(9)], long_waits=False)


class Unprobed(Gateway):
    """``Gateway`` that parks ``carol-1`` (so it holds carol) and never probes by itself: the
    test lets a waiting delivery run when it chooses."""

    pause = Pause(after=3, on=(LedgerDown,), probe_every=3600)

    async def handle(self, delivery: Delivery) -> None:
        if delivery.message_id == "carol-1":
            self.calls["carol"].append(1)
            raise Permanent("carol/1: no such account yet")
        await super().handle(delivery)


async def test_a_key_released_while_paused_waits_for_a_probe_like_any_delivery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder discarded while the queue is paused: the pass that hands its key's messages
    back leaves the first waiting, unstarted, where the lane's deliveries wait for a probe or
    the resume, instead of running it against the downstream that is down."""
    from rabbit_retry.worker.lane import Lane

    lanes: list[Lane] = []
    made = Lane.__init__

    def init(self: Lane, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        lanes.append(self)

    monkeypatch.setattr(Lane, "__init__", init)
    ledger = Unprobed()
    ledger.up = True
    users = [f"u{i}" for i in range(6)]
    async with broker_for(topology(delays="[1s]", attempts=3)) as broker, \
            broker.worker(ledger) as worker:
        for seq in (1, 2, 3):
            publish(broker, "carol", seq)
        await broker.settle(retries=True)
        assert [m.message_id for m in broker.parked(Q)] == ["carol-1"]  # it holds carol
        ledger.up = False
        for user in users:
            publish(broker, user, 1)
        metrics = worker.runner.metrics.for_queue(Q)

        def parked() -> list[str | None]:
            return [message_id for lane in lanes for message_id in lane._parked.values()]

        await broker.wait_for(lambda: metrics.paused and parked(), what="a pause, one waiting")
        discard(broker, "carol-1")
        await broker.wait_for(lambda: "carol-2" in parked() or ledger.calls["carol"] != [1],
                              what="carol-2 handed back")
        assert ledger.calls["carol"] == [1]  # not run while paused: it waits for a probe
        assert "carol-3" not in parked()  # behind carol-2, in the held queue still
        ledger.up = True
        assert any(lane.probe() is not None for lane in lanes)
        await broker.wait_for(lambda: not metrics.paused, what="the probe's success")
        await broker.settle(retries=True)
        assert held(broker) == 0 and broker.parked(Q) == []
    assert ledger.applied["carol"] == [2, 3]
    assert {u: ledger.applied[u] for u in users} == {u: [1] for u in users}
    never_backwards(ledger.calls)


async def test_a_worker_on_a_file_with_more_lanes_than_the_broker_says_to_run_migrate() -> None:
    """Started with the new file before ``migrate`` (which ``apply`` would refuse): one line
    naming the missing lane and ``migrate``; a queue never applied still says ``apply``."""
    from rabbit_retry.errors import BrokerError
    from rabbit_retry.worker.metrics import Metrics
    from rabbit_retry.worker.runner import check_objects, subscribe

    class Other(Ledger):
        queue = "rewards.other"

    async def check(yaml: str, consumer: Ledger | None = None) -> str:
        subs = subscribe([consumer or Ledger()], parse_topology(yaml, "r.yml"),
                         Metrics(exported=False))
        connection = await broker.connect()
        try:
            await check_objects(connection, subs, "r.yml")
        except BrokerError as error:
            return str(error)
        finally:
            await connection.close()
        return "found"

    async with broker_for(topology()) as broker:
        assert await check(topology()) == "found"  # positive control: the file applied
        assert await check(topology(lanes=LANES + 2)) == (
            f"queue '{Q}.lane.{LANES}' does not exist on the broker: the file gives {Q} "
            f"{LANES + 2} lanes, the broker {LANES}; run `rabbit-retry migrate r.yml` first (it "
            "adds lanes to a live ordered queue), or, if migrate took lanes away, run this worker "
            "with the file of 3 lanes")
        other = topology().replace(Q, "rewards.other")
        assert await check(other, Other()) == (
            "queue 'rewards.other' does not exist on the broker; run `rabbit-retry apply r.yml` "
            "first")


async def test_a_worker_on_a_file_with_fewer_lanes_than_the_broker_says_which_lanes_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Started with a file of fewer lanes before ``migrate`` took any away (or still on the old
    file after lanes were added): it consumes its file's lanes and says in a warning which
    lanes' keys wait for another worker; while ``migrate`` takes them away (its marker is
    there) it consumes them too, and says nothing (the control)."""
    from rabbit_retry.worker.metrics import Metrics
    from rabbit_retry.worker.runner import check_objects, subscribe

    async def lanes(yaml: str) -> dict[str, int]:
        subs = subscribe([Ledger()], parse_topology(yaml, "r.yml"), Metrics(exported=False))
        connection = await broker.connect()
        try:
            return await check_objects(connection, subs, "r.yml")
        finally:
            await connection.close()

    async with broker_for(topology()) as broker:
        with caplog.at_level("WARNING", logger="rabbit_retry.worker"):
            assert await lanes(topology(lanes=LANES - 1)) == {Q: LANES - 1}
        [warning] = [r.getMessage() for r in caplog.records if "lanes on the broker" in
                     r.getMessage()]
        assert warning == (
            f"queue={Q} has {LANES} lanes on the broker, {LANES - 1} in this worker's file: it "
            f"consumes lanes 0-{LANES - 2} only; the keys of lane {LANES - 1} wait for a worker "
            f"with the file of {LANES} lanes (or run `rabbit-retry migrate` with this file "
            "first: it takes them away)")
        caplog.clear()
        broker.memory.declare_queue(f"{Q}.lanes.{LANES}-to-{LANES - 1}", durable=True)
        with caplog.at_level("WARNING", logger="rabbit_retry.worker"):
            assert await lanes(topology(lanes=LANES - 1)) == {Q: LANES}
        assert not [r for r in caplog.records if "lanes on the broker" in r.getMessage()]


async def test_a_keys_message_arriving_as_the_held_queue_is_read_waits_behind_earlier_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lane admits nothing while it reads its held queue (on taking the lane over, and on each
    pass). A key's later message that arrives just as the read ends, before the earlier message
    waiting for that read has run again, must still wait behind it (a kill test on 4.0 ran
    u1-002 before u1-001 so)."""
    from rabbit_retry.worker.ordered import OrderedLane

    take_all = OrderedLane._take_all
    later: list[int] = []

    async def read_then_deliver(self: OrderedLane) -> Any:
        taken = await take_all(self)
        if not later:  # the first read: the key's next message arrives as it ends
            later.append(2)
            publish(broker, "erin", 2)
            broker.memory.dispatch()  # its task made now, as a socket read in this turn would
        return taken

    monkeypatch.setattr(OrderedLane, "_take_all", read_then_deliver)
    ledger = Ledger()
    async with broker_for(topology()) as broker, broker.worker(ledger):
        publish(broker, "erin", 1)  # the lane's first delivery: it waits for the first read
        await broker.settle()
    assert later == [2]  # positive control: the later message came during the read
    assert ledger.calls["erin"] == [1, 2], ledger.calls


# --- adding lanes (migrate) --------------------------------------------------------------------


def test_a_new_lane_is_gated_until_every_lane_before_it_passed() -> None:
    from rabbit_retry.held import Entry, change_id
    from rabbit_retry.worker.ordering import fold, plan

    change = change_id(2, 4)
    gate = Entry("gate", "", 0, change, lanes=(0, 1, 2))
    entries: list[Entry | None] = [
        gate, Entry("message", "ann", 1), Entry("passed", "", 2, change, lanes=(0,)),
        Entry("message", "ann", 3), Entry("passed", "", 4, change, lanes=(0,)),  # twice
        Entry("fence", "", 5, change, lanes=(3,)),
    ]
    folded = fold(entries)
    assert folded.gates == {change: {1, 2}} and folded.fences == {change: ((3,), ())}
    todo = plan(entries, folded)
    assert todo.handle == {} and todo.keep == [0, 1, 2, 3, 5] and todo.drop == [4]
    entries += [Entry("passed", "", 6, change, lanes=(1,)), Entry("passed", "", 7, change,
                                                                   lanes=(2,))]
    folded = fold(entries)
    assert not folded.gated
    todo = plan(entries, folded)  # open: the messages handed back in order, the gate dropped
    assert todo.handle == {"ann": [1, 3]} and todo.keep == [5]
    entries.append(Entry("fenced", "", 8, change))
    folded = fold(entries)
    assert folded.fences == {} and plan(entries, folded).keep == []


def test_a_lane_remembers_the_last_deliveries_it_settled_and_forgets_the_oldest() -> None:
    from rabbit_retry.worker.ordering import Settled, fingerprint

    settled = Settled(3)
    prints = [fingerprint(f"m{n}", b"{}", {"user-id": "ann"}) for n in range(5)]
    for print_ in prints[:3]:
        settled.add(print_)
    settled.add(prints[0])  # settled again: the newest now
    settled.add(prints[3])  # one too many: the oldest (m1) goes
    assert [p in settled for p in prints] == [True, False, True, True, False]
    settled.add(None)  # no message id: never remembered, never matched
    assert None not in settled and len([p for p in prints if p in settled]) == 3


def _add_lane(broker: TestBroker, lanes: int) -> Any:
    """What ``migrate`` finds before it adds lane ``lanes - 1``: the worker's file has it, the
    broker's ring does not yet; returns the binding to add."""
    ring = broker.memory.bindings[f"{Q}.lanes"]
    [new] = [b for b in ring if b.queue == f"{Q}.lane.{lanes - 1}"]
    ring.remove(new)
    return new


@pytest.mark.parametrize("gated", [True, False])
async def test_keys_moved_to_an_added_lane_wait_for_their_earlier_messages(gated: bool) -> None:
    """``migrate`` from 3 lanes to 4 with messages waiting in the old lanes: a key the new lane
    takes runs there only after its earlier messages in the old lane (through a retry, and a
    park that keeps the new lane shut until it is replayed). Without the gate (the control)
    the new lane runs moved keys at once, before their earlier messages."""
    from rabbit_retry.held import Entry, change_id

    lanes, change = LANES + 1, change_id(LANES, LANES + 1)
    users = [f"u{n}" for n in range(24)]
    ledger = Ledger({("u1", 2): 1, ("u2", 3): "park"})
    async with broker_for(topology(lanes=lanes)) as broker:
        binding = _add_lane(broker, lanes)
        if gated:
            gate = Entry("gate", "", 0, change, lanes=tuple(range(LANES)))
            broker.publish(queue=f"{Q}.lane.{LANES}.held", headers=gate.headers())
        for seq in range(1, 6):
            for user in users:
                publish(broker, user, seq)
        async with broker.worker(ledger) as worker:
            broker.memory.bindings[f"{Q}.lanes"].append(binding)  # bound: some keys move
            for seq in range(6, 9):
                for user in users:
                    publish(broker, user, seq)
            for lane in range(LANES):
                broker.publish(queue=f"{Q}.lane.{lane}",
                               headers=Entry("fence", "", 0, change, lanes=(LANES,)).headers())
            await broker.settle(retries=True)
            moved = [u for u in users if ledger.calls[u] and ledger.calls[u][0] >= 6]
            if not gated:
                assert ledger.calls != {u: sorted(c) for u, c in ledger.calls.items()}
                return
            # u2 is parked in an old lane: that lane cannot pass, so the new one stays shut
            assert ledger.applied["u2"] == [1, 2] and moved == []
            waiting = {m.headers["user-id"] for m in broker.messages(f"{Q}.lane.{LANES}.held")
                       if m.headers.get("ordered-entry") == "message"}
            # held: u2, and each key waiting in the shut lane
            assert worker.runner.metrics.for_queue(Q).held()[0] == len(waiting | {"u2"}) > 1
            replay(broker, "u2-3")
            await broker.settle(retries=True)
            assert held(broker) == 0 and not broker.messages(f"{Q}.lane.{LANES}.held")
    assert {u: ledger.applied[u] for u in users} == {u: list(range(1, 9)) for u in users}
    never_backwards(ledger.calls)


@pytest.mark.parametrize("linger", [None, 0.5], ids=["default-runs", "slow-runs"])
async def test_a_lane_passes_only_once_the_broker_took_the_acks_of_its_keys_last_messages(
    monkeypatch: pytest.MonkeyPatch, linger: float | None
) -> None:
    """A key that moves to an added lane is held by a retry in its old lane; once its earlier
    messages there ran, the old lane sends ``passed`` and the new lane runs the key's next.
    The old lane's worker then dies. Before, ``passed`` could go out while the ack of the last
    message it handed back still waited in its run: the broker gave that message back, and a
    new worker ran it after the key's next one (found by a review: u: 1, 1, 2, 3, 2, 3)."""
    from rabbit_retry.held import Entry, change_id
    from rabbit_retry.worker import settle

    if linger is not None:  # a busy channel: a run waits longer for more acks
        monkeypatch.setattr(settle, "LINGER_S", linger)
        monkeypatch.setattr(settle, "STRAGGLER_S", linger)
    lanes, change = LANES + 1, change_id(LANES, LANES + 1)
    async with broker_for(topology(lanes=lanes)) as probe:  # a key the added lane takes
        for n in range(24):
            publish(probe, f"u{n}", 0)
        user = next(m.headers["user-id"] for m in probe.messages(f"{Q}.lane.{LANES}"))

    class Dies(Ledger):
        ack_run = 1000  # acks wait in long runs

        def __init__(self) -> None:
            super().__init__({(user, 1): 1})  # held by a retry in its old lane
            self.reached = asyncio.Event()

        async def handle(self, delivery: Delivery) -> None:
            if delivery.payload["seq"] == 3:  # in the added lane: the process dies here
                self.calls[user].append(3)
                self.reached.set()
                await asyncio.Event().wait()
            await super().handle(delivery)

    first, second = Dies(), Ledger()
    async with broker_for(topology(lanes=lanes)) as broker:
        binding = _add_lane(broker, lanes)
        broker.publish(queue=f"{Q}.lane.{LANES}.held",
                       headers=Entry("gate", "", 0, change, lanes=tuple(range(LANES))).headers())
        publish(broker, user, 1)
        publish(broker, user, 2)
        async with broker.worker(first) as worker:
            await broker.settle()  # user-1 in its tier, user-2 held in the old lane
            broker.memory.bindings[f"{Q}.lanes"].append(binding)  # bound: the key moves
            publish(broker, user, 3)
            for lane in range(LANES):
                broker.publish(queue=f"{Q}.lane.{lane}",
                               headers=Entry("fence", "", 0, change, lanes=(LANES,)).headers())
            settling = asyncio.ensure_future(broker.settle(retries=True))
            await asyncio.wait_for(first.reached.wait(), 10)
            settling.cancel()
            await worker.crash()
        async with broker.worker(second):
            await broker.settle(retries=True)
    calls = first.calls[user] + second.calls[user]
    assert 2 not in calls[calls.index(3):], calls
    assert second.applied[user][-1:] == [3]


# --- taking lanes away (migrate) ---------------------------------------------------------------


@pytest.mark.parametrize("gated", [True, False])
async def test_keys_of_a_removed_lane_wait_for_their_earlier_messages_there(gated: bool) -> None:
    """``migrate`` from 3 lanes to 2 with a backlog in every lane: the keys lane 2 had go to
    lanes 0 and 1, and run there only after their earlier messages in lane 2 (through a retry,
    and a park, which holds only its own key: every other key, moved or not, runs to its end
    meanwhile). Lane 2 drains on a worker whose file has 2 lanes: the parked message replayed
    there, its key's later messages follow in the remaining lane. Without the gates (the
    control) the remaining lanes run moved keys at once, before their earlier messages."""
    from rabbit_retry.held import Entry, change_id

    change = change_id(LANES, LANES - 1)
    users = [f"u{n}" for n in range(24)]
    async with broker_for(topology()) as probe:
        for user in users:
            publish(probe, user, 0)
        removed = [m.headers["user-id"] for m in probe.messages(f"{Q}.lane.{LANES - 1}")]
    retried, parked = removed[0], removed[1]
    ledger = Ledger({(retried, 2): 1, (parked, 3): "park"})
    async with broker_for(topology()) as broker:
        for seq in range(1, 6):
            for user in users:
                publish(broker, user, seq)
        async with broker.worker(ledger):
            if gated:
                for lane in range(LANES - 1):
                    broker.publish(queue=f"{Q}.lane.{lane}", headers=Entry(
                        "gate", "", 0, change, lanes=(LANES - 1,)).headers())
            broker.memory.declare_queue(f"{Q}.lanes.{LANES}-to-{LANES - 1}", durable=True)
            ring = broker.memory.bindings[f"{Q}.lanes"]
            ring[:] = [b for b in ring if b.queue != f"{Q}.lane.{LANES - 1}"]  # unbound
            for seq in range(6, 9):
                for user in users:
                    publish(broker, user, seq)
            broker.publish(queue=f"{Q}.lane.{LANES - 1}", headers=Entry(
                "fence", "", 0, change, lanes=tuple(range(LANES - 1))).headers())
            await broker.settle(retries=True)
            if not gated:
                assert ledger.calls != {u: sorted(c) for u, c in ledger.calls.items()}
                return
            # the parked key waits, and nothing else does
            assert ledger.applied[parked] == [1, 2]
            assert {u: ledger.applied[u] for u in users if u != parked} == {
                u: list(range(1, 9)) for u in users if u != parked}
        broker.topology = parse_topology(topology(lanes=LANES - 1), "rewards.yml")
        async with broker.worker(ledger):  # the new file: lane 2 still drains
            replay(broker, f"{parked}-3")
            await broker.settle(retries=True)
            lanes = range(LANES)
            assert [len(broker.messages(f"{Q}.lane.{n}.held")) for n in lanes] == [0, 0, 0]
    assert {u: ledger.applied[u] for u in users} == {u: list(range(1, 9)) for u in users}
    never_backwards(ledger.calls)


def _take_away_last(broker: TestBroker, lanes: int) -> None:
    """What ``migrate`` does to take lane ``lanes - 1`` away, up to its fence."""
    from rabbit_retry.contract import ORDERED_ENTRY
    from rabbit_retry.held import Entry, change_id

    change, last = change_id(lanes, lanes - 1), lanes - 1
    broker.memory.declare_queue(f"{Q}.lanes.{lanes}-to-{last}", durable=True)
    for lane in range(last):
        broker.publish(queue=f"{Q}.lane.{lane}",
                       headers=Entry("gate", "", 0, change, lanes=(last,)).headers())
    ring = broker.memory.bindings[f"{Q}.lanes"]
    ring[:] = [b for b in ring if b.queue != f"{Q}.lane.{last}"]
    broker.publish(queue=f"{Q}.lane.{last}",
                   headers=Entry("fence", "", 0, change, lanes=tuple(range(last))).headers())
    broker.publish(queue=f"{Q}.lanes.{lanes}-to-{last}", headers={ORDERED_ENTRY: "fence"})


async def test_a_release_that_comes_while_the_passed_entry_waits_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A removed lane passes, handing over a key held by a retry, and releases it once the
    retry is done; a remaining lane whose gate's ack is slow to confirm (a loaded broker) takes
    the release while its passed entry still waits for that. Before, the release found no hold
    and was dropped, and the passed entry then held the key for good (found by a review:
    applied 1, 2 and never 3). The key's held count is one, in the removed lane."""
    user = await _a_user_of_the_last_lane()
    confirmed = _slow_gate_acks(monkeypatch)
    ledger = Ledger({(user, 1): 1})
    async with broker_for(topology()) as broker:
        publish(broker, user, 1)
        publish(broker, user, 2)
        async with broker.worker(ledger) as worker:
            await broker.settle()  # user-1 in its tier, user-2 held in the last lane
            _take_away_last(broker, LANES)
            publish(broker, user, 3)  # to a remaining lane, behind its gate
            await asyncio.sleep(0.2)  # the lanes took the gates, the fence and the passes
            assert worker.runner.metrics.for_queue(Q).held()[0] == 1  # once, not per lane
            broker.memory.expire(broker.memory.next_expiry())  # user-1 back to its lane
            await broker.wait_for(lambda: any(
                m.headers.get("ordered-lanes") == str(LANES - 1)
                for m in broker.messages(f"{Q}.lanes.{LANES}-to-{LANES - 1}")), within=10)
            confirmed.set()
            await broker.settle(retries=True)
            assert held(broker) == 0
    assert ledger.applied[user] == [1, 2, 3]


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "control"])
async def test_a_release_taken_while_the_passed_entry_waits_survives_a_crash_before_it(
    monkeypatch: pytest.MonkeyPatch, crash: bool
) -> None:
    """A remaining lane takes a removed lane's release while its ``passed`` entry waits for the
    gate's ack, and its worker dies before the passed entry is written. The release is acked
    only once that entry is: the next worker gets both again, in order, and the key goes on
    (found by a review: the release was acked at once, and the next worker held the handed-over
    key again for good, its event 3 never applied)."""
    user = await _a_user_of_the_last_lane()
    confirmed = _slow_gate_acks(monkeypatch)
    first, second = Ledger({(user, 1): 1}), Ledger()
    async with broker_for(topology()) as broker:
        publish(broker, user, 1)
        publish(broker, user, 2)
        async with broker.worker(first) as worker:
            await broker.settle()
            _take_away_last(broker, LANES)
            publish(broker, user, 3)  # to a remaining lane, behind its gate
            await broker.wait_for(lambda: any(  # moved to that lane's held queue
                m.headers.get("user-id") == user for n in range(LANES - 1)
                for m in broker.messages(f"{Q}.lane.{n}.held")), within=10)
            broker.memory.expire(broker.memory.next_expiry())  # user-1 back to lane 2
            await broker.wait_for(lambda: any(
                m.headers.get("ordered-lanes") == str(LANES - 1)
                for m in broker.messages(f"{Q}.lanes.{LANES}-to-{LANES - 1}")), within=10)
            # the remaining lanes took the releases: each wrote its release entry
            await broker.wait_for(lambda: all(any(
                m.headers.get("ordered-entry") == "release"
                for m in broker.messages(f"{Q}.lane.{n}.held")) for n in range(LANES - 1)),
                within=10)
            # and time for what followed at once before the change: the release's ack, flushed
            # with the lane's grouped acks (with the change it waits for the passed entry)
            await asyncio.sleep(0.5)
            if crash:
                await worker.crash()
            else:
                confirmed.set()
                await broker.settle(retries=True)
        monkeypatch.undo()  # the next worker's gate acks are taken at once
        if crash:
            async with broker.worker(second):
                await broker.settle(retries=True)
        assert first.applied[user] + second.applied[user] == [1, 2, 3]
        assert held(broker) == 0


async def _a_user_of_the_last_lane() -> str:
    async with broker_for(topology()) as probe:
        for n in range(24):
            publish(probe, f"u{n}", 0)
        return str(next(m.headers["user-id"]
                        for m in probe.messages(f"{Q}.lane.{LANES - 1}")))


def _slow_gate_acks(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """A gate's ack is taken only once the returned event is set (a loaded broker)."""
    from rabbit_retry.worker.ordered import OrderedLane

    confirmed = asyncio.Event()
    original = OrderedLane._ack_taken

    async def slow(self: OrderedLane, tag: int) -> None:
        await original(self, tag)
        await confirmed.wait()

    monkeypatch.setattr(OrderedLane, "_ack_taken", slow)
    return confirmed
