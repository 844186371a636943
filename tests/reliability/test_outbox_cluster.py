"""The outbox relay rides the loss of a cluster node (scripts/cluster.sh; skipped without it).

An application adds events in transactions, paced, while a ``rabbit-retry relay`` given the
three nodes publishes them to a replicated quorum queue. The node that leads the queue (and
the node the relay is connected to, when they differ, after it) is killed (``kill -9``)
mid-stream and started again 20 s later; the application writes on until 1,000 more events
are committed after that. Every committed event arrives, none of a rolled-back
transaction, in order per key; the relay moved to a surviving node by itself (the same process
throughout) and said so once per loss.
"""

from __future__ import annotations

import time
from pathlib import Path

from support.amqp import drain_sync
from support.cluster import cluster_or_skip, leader
from support.outbox import (
    RelayProcess,
    Writer,
    events_topology,
    migrated,
    out_of_order,
    published,
)
from support.poll import wait_for

from rabbit_retry.broker.management import Management
from rabbit_retry.outbox import Outbox
from rabbit_retry.settings import Settings

DOWN_FOR_S = 20.0


def test_the_relay_rides_the_loss_of_the_node_leading_its_queue(
    fresh_vhost: Settings, tmp_path: Path, management: Management,
) -> None:
    cluster = cluster_or_skip(management)
    started = time.monotonic()
    topology = events_topology(fresh_vhost, tmp_path, "quorum")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    # Written until told to stop, not a fixed number: a fixed 20,000 were all published before
    # the kill once (the kill then came with nothing left to do).
    writer = Writer(url, Outbox(topology), 500_000, exchange="rel", routing_key="event.new",
                    pause=0.02)
    relay = RelayProcess(fresh_vhost, topology, url, tmp_path / "relay.log")
    try:
        writer.start()
        relay.start()
        pid = relay.process.pid if relay.process else None
        wait_for(lambda: published(url) >= 5_000, "5,000 published", within=600)
        victim = leader(management, fresh_vhost.vhost, "rel.events")
        cluster.kill(victim)
        at_kill = published(url)
        try:
            time.sleep(DOWN_FOR_S)  # the stream goes on while the node is down
        finally:
            cluster.start(victim)
        back = writer.written
        wait_for(lambda: writer.written >= back + 1_000, "1,000 more events written")
        writer.stop()
        writer.join()
        committed = len(writer.committed)
        # Positive control: the kill came while there was still work to do.
        assert at_kill < committed, (at_kill, committed)
        wait_for(lambda: published(url) == committed,
                 "every committed event published", within=900, interval=0.5)
        assert relay.process is not None and relay.process.pid == pid and not relay.exited(), \
            "the relay must move to a surviving node by itself"
        assert relay.stop() == 0
    finally:
        writer.stop()  # a failure above leaves it writing otherwise
        relay.ensure_dead()
    log = relay.log()
    assert "Traceback" not in log
    assert log.count("lost the broker") == log.count("broker back after") <= 1, log[-3000:]
    copies = drain_sync(fresh_vhost, "rel.events")
    arrived = {c.message_id for c in copies}
    assert writer.committed <= arrived, f"lost: {sorted(writer.committed - arrived)[:20]}"
    assert not arrived & writer.rolled_back
    assert out_of_order([c.body for c in copies]) == []
    print(f"[reliability] relay through the loss of {victim}: {committed} committed, "
          f"{len(copies)} delivered ({len(copies) - len(arrived)} duplicates); "
          f"{time.monotonic() - started:.0f}s")
