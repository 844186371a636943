"""Ordered keys under faults, on the real broker with real worker processes: two workers share
an ordered queue's lanes, the one consuming them is SIGKILLed mid-stream (twice, alternately) and
started again, messages fail and retry, two keys are held by a parked message until it is
replayed. Per key, the handler calls and successes the workers wrote to one append-only file
never go back to an earlier message once a later one of the key succeeded; every message
succeeds; nothing is left in a lane, a tier or a held queue.

A lane change (``migrate`` from 2 lanes to 4) under the same faults:
``test_lanes_added_mid_stream_keep_every_keys_order_through_sigkills``.

The broker-restart variant (``test_ordered_keys_survive_a_broker_restart``) stops and starts the
broker application: it is ``alone`` (tests/conftest.py), never run beside other tests.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rel_support import Worker, spec_body
from rel_support import records as recorded
from support.amqp import Outgoing, consumers, depth_sync, publish_sync, total_depth
from support.broker import enable_plugin, restart_app, version
from support.poll import wait_for
from support.process import apply, cli

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "rel.points"
LANES = 4
USERS = 24
EVENTS = 15
PARKED = {("u3", 7), ("u11", 12)}  # Permanent until ``fixed`` exists: they hold their keys
TOPOLOGY = f"""\
version: 1
exchanges:
  rel: {{type: topic}}
queues:
  {Q}:
    queue_type: %(type)s
    bindings: [{{exchange: rel, routing_key: points}}]
    ordered: {{key: {{header: user-id}}, lanes: {LANES}}}
    retry: {{delays: [200ms, 500ms], max_attempts: 5}}
"""
QUEUES = [Q, f"{Q}.retry.200ms", f"{Q}.retry.500ms",
          *(f"{Q}.lane.{i}" for i in range(LANES)), *(f"{Q}.lane.{i}.held" for i in range(LANES))]


def _stream(seed: str) -> list[Outgoing]:
    rng = random.Random(seed)
    messages = []
    for seq in range(1, EVENTS + 1):
        for u in range(USERS):
            user = f"u{u}"
            behaviour: dict[str, object] = {}
            if (user, seq) in PARKED:
                behaviour["fixable"] = True
            elif rng.random() < 0.2:
                behaviour["fail"] = rng.choice([1, 2])
            mid = f"{user}-{seq:03d}"
            messages.append(Outgoing(mid, spec_body(mid, **behaviour), {"user-id": user}))
    return messages


def _per_key(kind: str, directory: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for message_id, _attempt in recorded(directory, kind):
        user, seq = message_id.rsplit("-", 1)
        out.setdefault(user, []).append(int(seq))
    return out


def _never_back(directory: Path) -> None:
    """No call of a key's message after a later message of the key succeeded."""
    calls: list[tuple[str, int, str]] = []
    path = directory / "events"
    for line in path.read_text().splitlines():
        kind, message_id = line.split(" ")[:2]
        user, seq = message_id.rsplit("-", 1)
        calls.append((user, int(seq), kind))
    done: dict[str, int] = {}
    for user, seq, kind in calls:
        if seq < done.get(user, 0):  # what the key went through, for the failure's reader
            print("\n".join(line for line in path.read_text().splitlines()
                            if f" {user}-" in line))
            for log in sorted(directory.glob("*.log")):  # and what the workers said of it
                print(f"--- {log.name}")
                print("\n".join(line for line in log.read_text(errors="replace").splitlines()
                                if f"{user}-" in line or f"'{user}'" in line))
        assert seq >= done.get(user, 0), f"{user}: {seq} handled after {done[user]} succeeded"
        if kind == "ok":
            done[user] = max(done.get(user, 0), seq)


@pytest.fixture
def points(fresh_vhost: Settings, tmp_path: Path, management: Management) -> Path:
    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    return tmp_path


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_two_workers_one_killed_mid_stream_keep_every_keys_order(
    fresh_vhost: Settings, points: Path, records: Path, worker_guard: list[Worker],
    queue_type: str,
) -> None:
    topology = points / "points.yml"
    topology.write_text(TOPOLOGY % {"type": queue_type})
    apply(fresh_vhost, topology)
    first = Worker(fresh_vhost, topology, records, "Points", sleep_ms=20, prefetch=8,
                   log_name="first.log")
    second = Worker(fresh_vhost, topology, records, "Points", sleep_ms=20, prefetch=8,
                    log_name="second.log")
    worker_guard += [first, second]
    first.start()
    second.start()
    messages = _stream(queue_type)
    publish_sync(fresh_vhost, messages, exchange="rel", routing_key="points")
    # A parked message holds its key: the key's later messages wait for its replay too. (A
    # SIGKILL between a park's confirm and its hold's may park a message twice: at least once.)
    blocked = sum(EVENTS - seq + 1 for _user, seq in PARKED)
    total = len(messages) - blocked
    kills = 0
    for fraction, victim in ((0.25, first), (0.6, second)):
        wait_for(lambda f=fraction: len({m for m, _ in recorded(records, "ok")})
                 >= total * f, f"{fraction:.0%} of the messages handled")
        victim.kill()  # SIGKILL: whatever it held goes back, its lanes to the other worker
        kills += 1
        victim.start()
    ok = lambda: {m for m, _ in recorded(records, "ok")}  # noqa: E731
    wait_for(lambda: len(ok()) >= total, "every message but the parked ones handled")
    wait_for(lambda: total_depth(fresh_vhost, [f"{Q}.parking"]) >= len(PARKED),
             "the two held keys' messages parked")
    assert len(ok()) == total  # the held keys' later messages wait for them
    (records / "fixed").touch()
    done = cli(fresh_vhost, "parking", "replay", Q, "--yes")
    assert done.code == 0, done.err
    wait_for(lambda: len(ok()) == len(messages), "the replayed keys finished in order")
    wait_for(lambda: total_depth(fresh_vhost, QUEUES) == 0, "nothing left anywhere")
    first.stop()
    second.stop()
    handled = _every_key_handled_in_order(records)
    print(f"[reliability] ordered, {queue_type}: {len(messages)} messages, {kills} SIGKILLs, "
          f"{sum(len(s) for s in handled.values()) - len(messages)} handled twice")


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_a_paused_ordered_queue_keeps_every_keys_order_through_a_sigkill(
    fresh_vhost: Settings, points: Path, records: Path, worker_guard: list[Worker],
    queue_type: str,
) -> None:
    """Two workers with a ``Pause``, the ledger down: the worker on every lane trips, keeps
    its lanes and probes; it is SIGKILLed while paused (its waiting deliveries go back, its
    lanes to the other worker, which trips in turn with returned deliveries waiting to run
    one at a time: they go back to ``Q`` and its probes go on) and started again; then the
    ledger comes back. Every message succeeds, none parks (five attempts 200-500 ms apart
    would park every key's first message in the outage without the pause), per key nothing
    runs after a later message of the key succeeded, and nothing is left anywhere."""
    topology = points / "points.yml"
    topology.write_text(TOPOLOGY % {"type": queue_type})
    apply(fresh_vhost, topology)
    (records / "down").touch()
    workers = [Worker(fresh_vhost, topology, records, "PausedPoints", sleep_ms=5, prefetch=8,
                      log_name=f"{name}.log") for name in ("first", "second")]
    worker_guard += workers
    first, second = workers
    first.start()  # the first takes every lane; the second waits to take them over
    wait_for(lambda: all(consumers(fresh_vhost, f"{Q}.lane.{i}") for i in range(LANES)),
             "the first worker on every lane")
    second.start()
    rng = random.Random(f"paused-{queue_type}")
    messages = [Outgoing(f"u{u}-{seq:03d}",
                         spec_body(f"u{u}-{seq:03d}", fail=rng.choice([0, 0, 0, 0, 1])),
                         {"user-id": f"u{u}"})
                for seq in range(1, 9) for u in range(USERS)]
    publish_sync(fresh_vhost, messages, exchange="rel", routing_key="points")
    paused = lambda: [w for w in workers if "paused queue=rel.points" in w.log()]  # noqa: E731
    calls = lambda: len(recorded(records, "calls"))  # noqa: E731
    wait_for(lambda: paused() and calls() >= 3 + 10, "a pause and its probes failing")
    assert paused() == [first]  # the second one has no lane: it trips once it has them
    first.kill()
    first.start()
    before = calls()
    wait_for(lambda: calls() >= before + 10, "probes after the SIGKILL")
    (records / "down").unlink()
    ok = lambda: {m for m, _ in recorded(records, "ok")}  # noqa: E731
    wait_for(lambda: len(ok()) == len(messages), "every message handled")
    wait_for(lambda: total_depth(fresh_vhost, QUEUES) == 0, "nothing left anywhere")
    for worker in workers:
        worker.stop()
    assert total_depth(fresh_vhost, [f"{Q}.parking"]) == 0
    _never_back(records)
    handled = _per_key("ok", records)
    assert {u: sorted(set(s)) for u, s in handled.items()} == {
        f"u{u}": list(range(1, 9)) for u in range(USERS)}
    print(f"[reliability] paused ordered, {queue_type}: {len(messages)} messages, "
          f"{sum('paused queue=' in line for w in workers for line in w.log().splitlines())}"
          f" pauses, {sum(len(s) for s in handled.values()) - len(messages)} handled twice")


def test_ordered_keys_survive_a_broker_restart(
    fresh_vhost: Settings, points: Path, records: Path, worker_guard: list[Worker],
    management: Management,
) -> None:
    """The broker application stops mid-stream and starts again (``alone`` in
    tests/conftest.py: never beside other tests); the worker reconnects, reads its lanes' held
    queues again and goes on in order."""
    topology = points / "points.yml"
    topology.write_text(TOPOLOGY % {"type": "quorum"})
    apply(fresh_vhost, topology)
    worker = Worker(fresh_vhost, topology, records, "Points", sleep_ms=20, prefetch=8)
    worker_guard.append(worker)
    worker.start()
    messages = [m for m in _stream("restart") if b"fixable" not in m.body]
    publish_sync(fresh_vhost, messages, exchange="rel", routing_key="points")
    wait_for(lambda: len(recorded(records, "ok")) >= len(messages) // 3, "a third handled")
    restart_app(management)
    wait_for(lambda: len({m for m, _ in recorded(records, "ok")}) == len(messages),
             "every message handled after the restart", within=300)
    wait_for(lambda: total_depth(fresh_vhost, QUEUES) == 0, "nothing left anywhere")
    worker.stop()
    _never_back(records)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_lanes_added_mid_stream_keep_every_keys_order_through_sigkills(
    fresh_vhost: Settings, points: Path, records: Path, worker_guard: list[Worker],
    queue_type: str,
) -> None:
    """``migrate`` takes the queue from 2 lanes to 4 while a worker on the old file works
    through the stream, keys held by parked messages (a lane's fence cannot pass until they are
    replayed); that worker is SIGKILLed once it has taken a fence (the fences wait in the held
    queues) and two workers on the new file take every lane over, one of them SIGKILLed after
    the replay.
    Per key nothing runs after a later message of the key succeeded; every message succeeds;
    nothing is left in a lane, a tier or a held queue."""
    two, four = points / "two.yml", points / "four.yml"
    two.write_text((TOPOLOGY % {"type": queue_type}).replace(f"lanes: {LANES}", "lanes: 2"))
    four.write_text(TOPOLOGY % {"type": queue_type})
    apply(fresh_vhost, two)
    old = Worker(fresh_vhost, two, records, "Points", sleep_ms=20, prefetch=8,
                 log_name="old.log")
    worker_guard.append(old)
    old.start()
    messages = _stream(f"lanes-{queue_type}")
    half = len(messages) // 2
    publish_sync(fresh_vhost, messages[:half], exchange="rel", routing_key="points")
    done = cli(fresh_vhost, "migrate", str(four), "--yes")
    assert done.code == 0 and "added lanes" in done.out, done.out + done.err
    publish_sync(fresh_vhost, messages[half:], exchange="rel", routing_key="points")
    ok = lambda: {m for m, _ in recorded(records, "ok")}  # noqa: E731
    wait_for(lambda: len(ok()) >= half // 2, "a quarter handled")
    log = records / "old.log"
    wait_for(lambda: "fenced for lanes" in log.read_text(errors="replace"),
             "the old worker took a fence")
    old.kill()  # its lanes' fences (and what they wait for) are in the held queues
    new = [Worker(fresh_vhost, four, records, "Points", sleep_ms=20, prefetch=8,
                  log_name=f"new{n}.log") for n in (1, 2)]
    worker_guard.extend(new)
    for worker in new:
        worker.start()
    # A parked key keeps its lane from passing, and so the new lanes shut: a held key that
    # moved to one cannot park before the other is replayed.
    _replayed_to_the_end(fresh_vhost, records, len(messages), new)
    for worker in new:
        worker.stop()
    _every_key_handled_in_order(records)
    moved = [line for line in (records / "new1.log").read_text(errors="replace").splitlines()
             + (records / "new2.log").read_text(errors="replace").splitlines()
             if "every lane before it passed" in line]
    assert moved, "no new lane opened: the test did not test a change"  # positive control


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_lanes_taken_away_mid_stream_keep_every_keys_order_through_sigkills(
    fresh_vhost: Settings, points: Path, records: Path, worker_guard: list[Worker],
    queue_type: str, management: Management,
) -> None:
    """``migrate`` takes the queue from 4 lanes to 2 while a worker on the old file works
    through the stream, keys held by parked messages (a removed lane hands its held keys over and
    goes on with them); that worker is SIGKILLed once a removed lane has passed, and two workers
    on the new file take every lane over (the removed ones too, while the change is under way),
    one of them SIGKILLed after the replay; a second ``migrate`` deletes the removed lanes.
    Per key nothing runs after a later message of the key succeeded; every message succeeds;
    nothing is left in a lane, a tier or a held queue."""
    if version(management) < (4, 3):
        pytest.skip("fewer lanes is refused before RabbitMQ 4.3 (test_ordered_on_rabbitmq "
                    "checks the refusal there)")
    four, two = points / "four.yml", points / "two.yml"
    four.write_text(TOPOLOGY % {"type": queue_type})
    two.write_text((TOPOLOGY % {"type": queue_type}).replace(f"lanes: {LANES}", "lanes: 2"))
    apply(fresh_vhost, four)
    old = Worker(fresh_vhost, four, records, "Points", sleep_ms=20, prefetch=8,
                 log_name="old.log")
    worker_guard.append(old)
    old.start()
    messages = _stream(f"fewer-{queue_type}")
    half = len(messages) // 2
    publish_sync(fresh_vhost, messages[:half], exchange="rel", routing_key="points")
    done = cli(fresh_vhost, "migrate", str(two), "--yes")
    assert done.code == 0 and "changed lanes" in done.out, done.out + done.err
    publish_sync(fresh_vhost, messages[half:], exchange="rel", routing_key="points")
    ok = lambda: {m for m, _ in recorded(records, "ok")}  # noqa: E731
    wait_for(lambda: len(ok()) >= half // 2, "a quarter handled")
    log = records / "old.log"
    wait_for(lambda: "is taken away" in log.read_text(errors="replace"),
             "a removed lane passed on the old worker")
    old.kill()  # the keys its removed lanes handed over are in their fences, in the held queues
    new = [Worker(fresh_vhost, two, records, "Points", sleep_ms=20, prefetch=8,
                  log_name=f"new{n}.log") for n in (1, 2)]
    worker_guard.extend(new)
    for worker in new:
        worker.start()
    _replayed_to_the_end(fresh_vhost, records, len(messages), new)
    again = cli(fresh_vhost, "migrate", str(two), "--yes")  # the removed lanes are done
    assert again.code == 0 and "2 lanes" in again.out, again.out + again.err
    for worker in new:
        worker.stop()
    _every_key_handled_in_order(records)
    gone = [depth_sync(fresh_vhost, f"{Q}.lane.{n}{h}") for n in (2, 3) for h in ("", ".held")]
    assert gone == [None] * 4  # deleted


def _replayed_to_the_end(settings: Settings, records: Path, total: int,
                         new: list[Worker]) -> None:
    """Once a held key has parked: the handler fixed, the parked messages replayed until every
    message is handled, the first new worker SIGKILLed and started again at 80%; nothing is
    left in a lane, a tier or a held queue."""
    wait_for(lambda: total_depth(settings, [f"{Q}.parking"]) >= 1, "a held key parked")
    (records / "fixed").touch()

    def replayed(enough: int) -> bool:
        if total_depth(settings, [f"{Q}.parking"]):
            done = cli(settings, "parking", "replay", Q, "--yes")
            assert done.code == 0, done.err
        return len({m for m, _ in recorded(records, "ok")}) >= enough

    wait_for(lambda: replayed(int(total * 0.8)), "80% handled")
    new[0].kill()
    new[0].start()
    wait_for(lambda: replayed(total), "every message handled", within=180)
    wait_for(lambda: total_depth(settings, QUEUES) == 0, "nothing left anywhere")


def _every_key_handled_in_order(records: Path) -> dict[str, list[int]]:
    """Every key's events handled, none after a later one of its key succeeded; per key, the
    events handled (a redelivered one twice)."""
    handled = _per_key("ok", records)
    assert {u: sorted(set(s)) for u, s in handled.items()} == {
        f"u{u}": list(range(1, EVENTS + 1)) for u in range(USERS)}
    _never_back(records)
    return handled
