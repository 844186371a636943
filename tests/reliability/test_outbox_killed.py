"""The outbox relay under kill -9: 50,000 events added by an application in transactions (a
seventh of them rolled back) while two ``rabbit-retry relay`` processes publish them and each is
killed twice. Every committed event arrives, none of a rolled-back transaction does, the events
of each order key arrive in order, and the duplicates (events a killed relay had in flight) are
counted and stay within the window a relay has in flight. On PostgreSQL both relays publish at
once; on SQLite one holds the lease and the other takes over when it dies.

The broker restarted under a relay: test_outbox_broker_restart.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.amqp import depth_sync, drain_sync
from support.outbox import (
    RelayProcess,
    Writer,
    events_topology,
    migrated,
    out_of_order,
    outbox_store,
    published,
    statuses,
)
from support.poll import wait_for

from rabbit_retry.outbox import Outbox
from rabbit_retry.outbox.relay import BATCH, DEPTH
from rabbit_retry.settings import Settings

EVENTS = 50_000
STORES = ["sqlite", "postgresql"]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", STORES)
def test_two_relays_each_killed_twice_deliver_every_committed_event_in_key_order(
    fresh_vhost: Settings, tmp_path: Path, kind: str,
) -> None:
    started = time.monotonic()
    topology = events_topology(fresh_vhost, tmp_path, "classic")
    with outbox_store(kind, tmp_path) as url:
        relays = [RelayProcess(fresh_vhost, topology, url, tmp_path / f"relay-{n}.log")
                  for n in (1, 2)]
        writer = Writer(url, Outbox(topology), EVENTS, exchange="rel", routing_key="event.new")
        try:
            migrated(url)
            # A backlog first, so that the relays are busy (events in flight) when killed.
            writer.start()
            wait_for(lambda: writer.written >= EVENTS // 2, "half the events written",
                     within=600)
            for relay in relays:
                relay.start()
            kills = 0
            # Each relay killed twice, at a fifth, two, three and four fifths of the stream.
            for n, share in enumerate((0.2, 0.4, 0.6, 0.8)):
                victim = relays[n % 2]
                if kind == "sqlite":  # kill the one that publishes (the other waits)
                    victim = max(relays, key=lambda r: r.log().rfind("holds the lease"))
                at_least = int(EVENTS * 6 / 7 * share)
                wait_for(lambda a=at_least: published(url) >= a, f"{at_least} published",
                         within=600, interval=0.05)
                victim.kill()
                kills += 1
                at_kill = published(url)
                print(f"[reliability] relay killed with {at_kill} events published, "
                      f"{depth_sync(fresh_vhost, 'rel.events')} in the queue")
                victim.start()
            writer.join()
            committed = len(writer.committed)
            # Positive control: the kills came while events were still being written and sent.
            assert at_kill < committed, (at_kill, committed)
            try:
                wait_for(lambda: published(url) == committed,
                         "every committed event published", within=900, interval=0.5)
            except AssertionError:
                for relay in relays:
                    print(relay.log()[-3000:])
                raise
            assert statuses(url) == {"published": committed}
            for relay in relays:
                assert relay.stop() == 0, relay.log()[-3000:]
        finally:
            for relay in relays:
                relay.ensure_dead()
    copies = drain_sync(fresh_vhost, "rel.events")
    ids = [c.message_id for c in copies]
    arrived = set(ids)
    assert writer.committed <= arrived, f"lost: {sorted(writer.committed - arrived)[:20]}"
    assert not arrived & writer.rolled_back, "an event of a rolled-back transaction arrived"
    assert arrived <= writer.committed | writer.rolled_back
    duplicates = len(ids) - len(arrived)
    print(f"[reliability] outbox on {kind}: {committed} committed, "
          f"{len(writer.rolled_back)} rolled back, {len(ids)} delivered, {duplicates} "
          f"duplicates after {kills} kills (window {DEPTH * BATCH}); "
          f"{time.monotonic() - started:.0f}s")
    assert out_of_order([c.body for c in copies]) == []
    assert duplicates <= kills * DEPTH * BATCH
