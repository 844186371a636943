"""An ordered queue on the real broker: apply creates it (a second apply has nothing to do),
status counts its held keys, and two workers in this process apply each user's events in order
through a retry, a parked message replayed and one purged (its key released)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from support.amqp import Outgoing, depth, on_channel, publish_raw
from support.broker import enable_plugin, version
from support.poll import eventually
from support.process import Ran, cli
from support.provision import topology
from support.worker import running

from rabbit_retry import Delivery, Pause, Permanent, RetryConsumer
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "rewards.points"
TOPOLOGY = f"""\
version: 1
exchanges:
  rewards: {{type: topic}}
queues:
  {Q}:
    queue_type: QTYPE
    bindings: [{{exchange: rewards, routing_key: "points.*"}}]
    ordered: {{key: {{header: user-id}}, lanes: 3}}
    retry: {{delays: [200ms], max_attempts: 3}}
"""


class Ledger(RetryConsumer):
    queue = Q
    prefetch = 5

    def __init__(self, applied: dict[str, list[int]], plan: dict[tuple[str, int], Any]) -> None:
        self.applied = applied
        self.plan = plan

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        step = self.plan.get((user, seq), 0)
        if step == "park":
            raise Permanent(f"{user}/{seq}: not yet")
        if step and delivery.attempt <= step:
            raise RuntimeError("busy")
        self.applied[user].append(seq)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_apply_status_and_two_workers_keep_each_keys_order(
    fresh_vhost: Settings, management: Management, tmp_path: Path, queue_type: str,
) -> None:
    async def run_cli(*args: str) -> Ran:  # in a thread: the workers run on this loop
        return await asyncio.to_thread(cli, fresh_vhost, *args)

    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    file = tmp_path / "rewards.yml"
    file.write_text(TOPOLOGY.replace("QTYPE", queue_type))
    assert (await run_cli("apply", str(file))).code == 0
    again = await run_cli("apply", str(file))
    assert "nothing to do" in again.out, again.out + again.err
    applied: dict[str, list[int]] = defaultdict(list)
    plan: dict[tuple[str, int], Any] = {("ann", 2): 1, ("ben", 3): "park", ("cat", 1): "park"}
    topo = topology(file.read_text())
    users = ("ann", "ben", "cat", "dee")
    async with running([Ledger(applied, plan)], topo, fresh_vhost), \
            running([Ledger(applied, plan)], topo, fresh_vhost):
        await publish_raw(fresh_vhost, [
            Outgoing(f"{u}-{s}", json.dumps({"seq": s}).encode(), {"user-id": u}).wire()
            for s in range(1, 6) for u in users], exchange="rewards", routing_key="points.x")
        await eventually(lambda: len(applied["ann"]) == 5 and len(applied["dee"]) == 5,
                         within=90, what="ann (through a retry) and dee done")
        async def both_parked() -> bool:
            return await depth(fresh_vhost, f"{Q}.parking") == 2

        await eventually(both_parked, what="ben's and cat's parked")
        status = json.loads((await run_cli("status", str(file), "--json")).out)["queues"][0]
        assert status["held_keys"] == 2  # ben and cat, each held by its parked message
        assert status["held_messages"] >= 2 + 2 + 4  # ben 4-5, cat 2-5, and their holds
        assert applied["ben"] == [1, 2] and applied["cat"] == []
        plan[("ben", 3)] = 0  # fixed: replay ben's
        done = await run_cli("parking", "replay", Q, "--where", "ordered-key=ben", "--yes")
        assert done.code == 0, done.err
        done = await run_cli("parking", "purge", Q, "--yes")  # cat's: dropped
        assert done.code == 0, done.err
        await eventually(lambda: len(applied["ben"]) == 5 and len(applied["cat"]) == 4,
                         what="ben and cat finished")
    assert dict(applied) == {"ann": [1, 2, 3, 4, 5], "ben": [1, 2, 3, 4, 5],
                             "cat": [2, 3, 4, 5], "dee": [1, 2, 3, 4, 5]}


class Paced(RetryConsumer):
    """Records who handled each user's events (``by``), ``pace`` seconds each; the first attempt
    of ``(user, seq)`` in ``fail`` fails."""

    queue = Q
    prefetch = 2

    def __init__(self, by: str, calls: dict[str, list[tuple[int, str]]], pace: float,
                 fail: set[tuple[str, int]]) -> None:
        self.by, self.calls, self.pace, self.fail = by, calls, pace, fail

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        self.calls[user].append((seq, self.by))
        await asyncio.sleep(self.pace)
        if (user, seq) in self.fail and delivery.attempt == 1:
            raise RuntimeError("busy")


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_migrate_adds_lanes_to_a_live_queue_and_every_key_keeps_its_order(
    fresh_vhost: Settings, management: Management, tmp_path: Path, queue_type: str,
) -> None:
    """From 2 lanes to 4 while a slow worker on the old file still works through each lane's
    backlog (with retries) and events keep coming: a key that moves to a new lane runs there
    (on a fast worker with the new file) only after its earlier events in the old lane."""
    async def run_cli(*args: str) -> Ran:  # in a thread: the workers run on this loop
        return await asyncio.to_thread(cli, fresh_vhost, *args)

    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    two, four = tmp_path / "two.yml", tmp_path / "four.yml"
    two.write_text(TOPOLOGY.replace("QTYPE", queue_type).replace("lanes: 3", "lanes: 2"))
    four.write_text(TOPOLOGY.replace("QTYPE", queue_type).replace("lanes: 3", "lanes: 4"))
    assert (await run_cli("apply", str(two))).code == 0
    planned = await run_cli("plan", str(four))
    assert planned.code == 3 and "1 ordered queue must get more lanes" in planned.err, (
        planned.out + planned.err)
    assert "migrate adds lanes 2-3" in planned.out
    refused = await run_cli("apply", str(four))
    assert refused.code == 3 and "adds the lanes and keeps each key's order" in refused.err, (
        refused.out + refused.err)
    users = [f"u{n}" for n in range(40)]
    calls: dict[str, list[tuple[int, str]]] = defaultdict(list)
    fail = {(u, 2) for u in users[::5]}

    def events(seqs: range) -> list[tuple[bytes, Any]]:
        return [Outgoing(f"{u}-{s}", json.dumps({"seq": s}).encode(), {"user-id": u}).wire()
                for s in seqs for u in users]

    async with running([Paced("old", calls, 0.03, fail)], topology(two.read_text()),
                       fresh_vhost):
        await publish_raw(fresh_vhost, events(range(1, 6)), exchange="rewards",
                          routing_key="points.x")
        during = asyncio.create_task(publish_raw(fresh_vhost, events(range(6, 9)),
                                                 exchange="rewards", routing_key="points.x"))
        done = await run_cli("migrate", str(four), "--yes")
        assert done.code == 0 and "added lanes" in done.out, done.out + done.err
        await during
        await publish_raw(fresh_vhost, events(range(9, 13)), exchange="rewards",
                          routing_key="points.x")
        async with running([Paced("new", calls, 0.0, fail)], topology(four.read_text()),
                           fresh_vhost):
            await eventually(lambda: all(len({s for s, _ in calls[u]}) == 12 for u in users),
                             within=120, what="every user's 12 events handled")
    again = await run_cli("plan", str(four))
    assert again.code == 0 and "0 to create" in again.out and "0 to migrate" in again.out, (
        again.out + again.err)
    for user in users:
        seqs = [s for s, _ in calls[user]]
        assert seqs == sorted(seqs), (user, calls[user])
    moved = [u for u in users if {b for _, b in calls[u]} == {"old", "new"}]
    # positive control: keys did move, and each had events left in its old lane to wait for
    assert moved, dict(calls)
    left = [await depth(fresh_vhost, f"{Q}.lane.{n}.held") for n in range(4)]
    assert left == [0, 0, 0, 0]  # no gate, fence or passed entry left behind


class Parks(Paced):
    """``Paced``, and the events in ``park`` are parked (until the set is emptied)."""

    def __init__(self, by: str, calls: dict[str, list[tuple[int, str]]], pace: float,
                 fail: set[tuple[str, int]], park: set[tuple[str, int]]) -> None:
        super().__init__(by, calls, pace, fail)
        self.park = park

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        if (user, seq) in self.park:
            self.calls[user].append((seq, self.by))
            raise Permanent(f"{user}/{seq}: not yet")
        await super().handle(delivery)


async def test_migrate_takes_lanes_away_from_a_live_queue_and_every_key_keeps_its_order(
    fresh_vhost: Settings, management: Management, tmp_path: Path,
) -> None:
    """From 4 lanes to 2 (RabbitMQ 4.3 and later; refused before) while a slow worker on the
    old file works through each lane's backlog (with retries and parks) and events keep coming:
    a key of a removed lane runs in a remaining lane only after its earlier events, a key held
    by a parked message waits there until it is replayed, every other key runs to its end
    meanwhile, and a second migrate deletes the removed lanes once they are done."""
    async def run_cli(*args: str) -> Ran:  # in a thread: the workers run on this loop
        return await asyncio.to_thread(cli, fresh_vhost, *args)

    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    four, two = tmp_path / "four.yml", tmp_path / "two.yml"
    four.write_text(TOPOLOGY.replace("QTYPE", "quorum").replace("lanes: 3", "lanes: 4"))
    two.write_text(TOPOLOGY.replace("QTYPE", "quorum").replace("lanes: 3", "lanes: 2"))
    assert (await run_cli("apply", str(four))).code == 0
    planned = await run_cli("plan", str(two))
    if version(management) < (4, 3):
        assert planned.code == 3 and "can get fewer lanes on RabbitMQ 4.3 and later" in (
            planned.out), planned.out + planned.err
        return
    assert "migrate takes away lanes 2-3" in planned.out, planned.out + planned.err
    assert "1 ordered queue must get fewer lanes; apply would refuse" in planned.err, planned.err
    refused = await run_cli("apply", str(two))
    assert refused.code == 3 and "takes the lanes away and keeps each key's order" in (
        refused.err), refused.out + refused.err
    users = [f"u{n}" for n in range(40)]
    calls: dict[str, list[tuple[int, str]]] = defaultdict(list)
    fail, park = {(u, 2) for u in users[::5]}, {(u, 3) for u in users[1:9]}
    parked = {u for u, _ in park}

    def events(seqs: range) -> list[tuple[bytes, Any]]:
        return [Outgoing(f"{u}-{s}", json.dumps({"seq": s}).encode(), {"user-id": u}).wire()
                for s in seqs for u in users]

    def done(user: str) -> bool:
        return len({s for s, _ in calls[user]}) == 12

    async with running([Parks("old", calls, 0.03, fail, park)], topology(four.read_text()),
                       fresh_vhost):
        await publish_raw(fresh_vhost, events(range(1, 6)), exchange="rewards",
                          routing_key="points.x")
        during = asyncio.create_task(publish_raw(fresh_vhost, events(range(6, 9)),
                                                 exchange="rewards", routing_key="points.x"))
        first = await run_cli("migrate", str(two), "--yes")
        assert first.code == 0 and "still holds keys" in first.out, first.out + first.err
        # positive control: a removed lane hands keys over (its fence names them)
        held = [await depth(fresh_vhost, f"{Q}.lane.{n}.held") for n in (2, 3)]
        await during
        await publish_raw(fresh_vhost, events(range(9, 13)), exchange="rewards",
                          routing_key="points.x")
        async with running([Parks("new", calls, 0.0, fail, park)], topology(two.read_text()),
                           fresh_vhost):
            await eventually(lambda: all(done(u) for u in users if u not in parked),
                             within=120, what="every key not parked: its 12 events handled")
            stuck = [u for u in parked if not done(u)]
            assert stuck and all(max(s for s, _ in calls[u]) == 3 for u in stuck), dict(calls)
    async with running([Parks("new", calls, 0.0, fail, park)], topology(two.read_text()),
                       fresh_vhost):
        park.clear()
        replayed = await run_cli("parking", "replay", Q, "--yes")
        assert replayed.code == 0, replayed.out + replayed.err
        await eventually(lambda: all(done(u) for u in users), within=120,
                         what="the parked keys' events handled after the replay")
        second = await run_cli("migrate", str(two), "--yes")
        assert second.code == 0 and "2 lanes" in second.out, second.out + second.err
    for user in users:
        seqs = [s for s, _ in calls[user]]
        assert seqs == sorted(seqs), (user, calls[user])
    assert sum(h or 0 for h in held), held
    again = await run_cli("plan", str(two))
    assert again.code == 0 and "0 to migrate" in again.out, again.out + again.err
    assert [await depth(fresh_vhost, f"{Q}.lane.{n}") for n in (2, 3)] == [None, None]
    assert [await depth(fresh_vhost, f"{Q}.lane.{n}.held") for n in (0, 1)] == [0, 0]


class LedgerDown(ConnectionError):
    pass


class Outage(RetryConsumer):
    """Applies each user's events while ``state["down"]`` is False; pauses on its outage."""

    queue = Q
    prefetch = 3
    pause = Pause(after=3, on=(LedgerDown,), probe_every=0.2)

    def __init__(self, state: dict[str, bool], calls: dict[str, list[int]],
                 attempts: dict[str, int]) -> None:
        self.state, self.calls, self.attempts = state, calls, attempts

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        self.calls[user].append(seq)
        if self.state["down"]:
            raise LedgerDown("ledger service unreachable")
        self.attempts[f"{user}-{seq}"] = delivery.attempt


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_pause_keeps_the_lanes_charges_only_its_trip_and_every_key_keeps_its_order(
    fresh_vhost: Settings, management: Management, tmp_path: Path, queue_type: str,
) -> None:
    """Two workers, the ledger down for a while: the worker that trips keeps its lanes (they
    would go to the other worker mid-stream), probes while its deliveries wait, and sends a
    watched failure back holding its key. Nothing parks (with two attempts 200 ms apart, the
    outage would park every user's first event without the pause), only the failures that
    tripped a pause are charged, and each user's events are handled in order."""
    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    file = tmp_path / "rewards.yml"
    file.write_text(TOPOLOGY.replace("QTYPE", queue_type))
    assert (await asyncio.to_thread(cli, fresh_vhost, "apply", str(file))).code == 0
    topo = topology(file.read_text())
    state = {"down": True}
    calls: dict[str, list[int]] = defaultdict(list)
    attempts: dict[str, int] = {}
    users = [f"u{n}" for n in range(12)]
    async with running([Outage(state, calls, attempts)], topo, fresh_vhost) as first, \
            running([Outage(state, calls, attempts)], topo, fresh_vhost) as second:
        await publish_raw(fresh_vhost, [
            Outgoing(f"{u}-{s}", json.dumps({"seq": s}).encode(), {"user-id": u}).wire()
            for s in range(1, 6) for u in users], exchange="rewards", routing_key="points.x")
        metrics = [first.metrics.for_queue(Q), second.metrics.for_queue(Q)]
        await eventually(lambda: any(m.paused for m in metrics)
                         and sum(map(len, calls.values())) >= 3 + 15,
                         within=60, what="a pause and failed probes")
        state["down"] = False
        await eventually(lambda: len(attempts) == len(users) * 5, within=90,
                         what="every event handled")
        assert not any(m.paused for m in metrics)
        pauses = sum(m.pauses for m in metrics)
    assert 1 <= pauses <= 2
    for user in users:
        assert calls[user] == sorted(calls[user]), (user, calls[user])
    charged = [message for message, attempt in attempts.items() if attempt > 1]
    assert len(charged) <= 3 * pauses, charged
    assert await depth(fresh_vhost, f"{Q}.parking") == 0
    assert [await depth(fresh_vhost, f"{Q}.lane.{n}.held") for n in range(3)] == [0, 0, 0]


async def test_a_lane_change_migrate_began_is_finished_by_the_next_run_and_only_once(
    fresh_vhost: Settings, management: Management, tmp_path: Path,
) -> None:
    """A migrate stopped after it marked the change (its marker queue is there, nothing else):
    plan says so, the next migrate finishes it, and a third has nothing to do; each new lane's
    held queue has its one gate and each lane but the last its one fence (no worker runs)."""
    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    two, four = tmp_path / "two.yml", tmp_path / "four.yml"
    two.write_text(TOPOLOGY.replace("QTYPE", "quorum").replace("lanes: 3", "lanes: 2"))
    four.write_text(TOPOLOGY.replace("QTYPE", "quorum").replace("lanes: 3", "lanes: 4"))
    assert cli(fresh_vhost, "apply", str(two)).code == 0
    await on_channel(fresh_vhost, lambda ch: ch.queue_declare(f"{Q}.lanes.2-to-4", durable=True))
    planned = cli(fresh_vhost, "plan", str(four))
    assert "migrate began adding lanes 2-3" in planned.out, planned.out + planned.err
    done = cli(fresh_vhost, "migrate", str(four), "--yes")
    assert done.code == 0 and "added lanes" in done.out, done.out + done.err
    again = cli(fresh_vhost, "migrate", str(four), "--yes")
    assert again.code == 0 and "nothing to migrate" in again.out, again.out + again.err
    held = [await depth(fresh_vhost, f"{Q}.lane.{n}.held") for n in range(4)]
    lanes = [await depth(fresh_vhost, f"{Q}.lane.{n}") for n in range(4)]
    assert (held, lanes) == ([0, 0, 1, 1], [1, 1, 1, 0])
    assert await depth(fresh_vhost, f"{Q}.lanes.2-to-4") is None
