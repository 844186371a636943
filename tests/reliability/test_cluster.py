"""A node of the cluster dies under a running stream (scripts/cluster.sh; skipped without it).

20,000 messages (successes, transient failures that retry through the tiers, ``Permanent``
failures that park) worked by three worker processes, each given the node list starting at a
different node. The node leading the main queue is killed (``kill -9``) mid-stream and started
again 20 s later. Every message must succeed or park as expected, none lost; every worker must
still run, the ones on the dead node having moved to a surviving node by themselves. Duplicates
(a message handled again after its node died with the ack in flight) are counted and printed.
"""

from __future__ import annotations

import time
from pathlib import Path

from rel_support import Worker, mixed_stream, ok_ids, settle, spec_body
from support.amqp import Outgoing, publish_sync
from support.cluster import cluster_or_skip, leader, starting_at
from support.poll import wait_for
from support.process import apply

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

# The default topology: quorum queues, whose parking queues are quorum too, replicated on
# every node (with classic ones the node that held them took every park down with it: each
# lane filled with held parks and consumption stopped).
TOPOLOGY = """\
version: 1
exchanges:
  rel: {type: topic}
queues:
  rel.orders:
    bindings: [{exchange: rel, routing_key: orders}]
    retry: {delays: [200ms, 500ms], max_attempts: 4}
  rel.payments:
    bindings: [{exchange: rel, routing_key: payments}]
    retry: {delays: [300ms], max_attempts: 3}
"""
MAIN_AND_TIERS = ["rel.orders", "rel.orders.retry.200ms", "rel.orders.retry.500ms",
                  "rel.payments", "rel.payments.retry.300ms"]
PARKING = ["rel.orders.parking", "rel.payments.parking"]
ORDERS, PAYMENTS = 14_000, 6_000
DOWN_FOR_S = 20.0


def test_the_leader_of_a_main_queue_killed_mid_stream_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, records: Path, management: Management,
    worker_guard: list[Worker],
) -> None:
    cluster = cluster_or_skip(management)
    started = time.monotonic()
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY)
    apply(fresh_vhost, topology)
    o_messages, expected = mixed_stream("o", ORDERS)
    p_messages, p_expected = mixed_stream("p", PAYMENTS)
    expected.update(p_expected)
    publish_sync(fresh_vhost, o_messages, exchange="rel", routing_key="orders")
    publish_sync(fresh_vhost, p_messages, exchange="rel", routing_key="payments")

    workers = [
        Worker(starting_at(fresh_vhost, i), topology, records, "Orders", "Payments",
               sleep_ms=2, prefetch=20, log_name=f"worker-{i + 1}.log")
        for i in range(3)
    ]
    worker_guard.extend(workers)
    for worker in workers:
        worker.start()
    pids = [w.pid for w in workers]

    victim = leader(management, fresh_vhost.vhost, "rel.orders")
    to_succeed = sum(1 for v in expected.values() if v == "ok")
    wait_for(lambda: len(ok_ids(records)) >= to_succeed * 0.3, "30% of the successes",
             within=600)
    cluster.kill(victim)
    at_kill = len(ok_ids(records))
    # Positive control: the kill happened while there was still work to do.
    assert at_kill < to_succeed, "the stream finished before the kill; publish more"
    on_victim = workers[cluster.number(victim) - 1]
    wait_for(lambda: on_victim.log().count("reconnected after") >= 1,
             f"the worker that was on {victim} to move to a surviving node", within=300)
    time.sleep(DOWN_FOR_S)  # the node stays down while the stream goes on, then comes back
    cluster.start(victim)

    assert [w.pid for w in workers] == pids and not any(w.exited() for w in workers), (
        "every worker must still run"
    )
    ledger = settle(fresh_vhost, workers, expected, MAIN_AND_TIERS, PARKING, within=900)
    logs = [w.log() for w in workers]
    print(f"[reliability] killed {victim} (leader of rel.orders) at {at_kill} of {to_succeed} "
          f"successes, down {DOWN_FOR_S:g}s; reconnects per worker: "
          f"{[log.count('reconnected after') for log in logs]}")
    for log in logs:
        assert "Traceback" not in log, log[-3000:]
    ledger.check("leader of a main queue killed on a 3-node cluster", started)


CLASSIC = """\
version: 1
queues:
  rel.orders:
    queue_type: classic
    parking: {queue_type: classic}
    retry: {delays: [200ms], max_attempts: 3}
"""
WAITING = "exists but its node does not answer"


def test_a_worker_started_while_its_classic_queues_node_is_down_waits_then_consumes(
    fresh_vhost: Settings, tmp_path: Path, records: Path, management: Management,
    worker_guard: list[Worker],
) -> None:
    """A classic queue lives on the node that declared it. With that node down, the worker's
    startup check is refused NOT_FOUND as if the queue did not exist: the worker must wait for
    the node (one line), not exit with "run apply first", and consume once it is back."""
    cluster = cluster_or_skip(management)
    home = cluster.nodes[2]
    topology = tmp_path / "classic.yml"
    topology.write_text(CLASSIC)
    apply(starting_at(fresh_vhost, 2), topology)  # declared over the last node: they live there
    for name in ("rel.orders", "rel.orders.parking"):
        info = management.queue(fresh_vhost.vhost, name)
        assert info is not None and info["node"] == home, info
    messages = [Outgoing(f"m-{i}", spec_body(f"m-{i}")) for i in range(200)]
    publish_sync(fresh_vhost, messages, routing_key="rel.orders")

    worker = Worker(fresh_vhost, topology, records, "Orders")  # the list starts at c1
    worker_guard.append(worker)
    with cluster.down(home):
        started = time.monotonic()
        worker.start(consuming=False)
        line = wait_for(
            lambda: next((x for x in worker.log().splitlines() if WAITING in x), None),
            "the worker to say it waits for the node", within=300,
            unless=lambda: f"exited:\n{worker.log()[-3000:]}" if worker.exited() else None)
        waited_s = time.monotonic() - started
        # The event, not a window: the worker said it waits, so it has not consumed.
        assert not worker.exited() and ok_ids(records) == set()
        assert "run `rabbit-retry apply" not in worker.log()
        print(f"[cluster] {home} down; after {waited_s:.1f}s the worker logged: {line}")
    wait_for(lambda: len(ok_ids(records)) == len(messages),
             f"every message handled once {home} is back", within=600,
             unless=lambda: f"exited:\n{worker.log()[-3000:]}" if worker.exited() else None)
    log = worker.log()
    assert log.count(WAITING) == 1 and log.count("the node is back after") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    worker.stop()
    back = next(x for x in log.splitlines() if "the node is back after" in x)
    print(f"[cluster] then: {back}")
