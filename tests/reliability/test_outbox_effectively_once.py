"""Outbox, relay and idempotent consumer end to end: effectively once. An application adds
3,000 events in transactions (a seventh rolled back); a ``rabbit-retry relay`` publishes them
and is killed twice, so some events are published twice; a ``rabbit-retry worker`` whose
consumer has ``Idempotency`` (key: the message id the event was added with) handles them and is
killed twice too. Counting the handler's side effects: every committed event's happened, none
of a rolled-back one's, and an event's happened twice only where the README says it can (the
worker killed after the side effect, before its store recorded it): never because the relay
published it twice."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rel_support import Worker, ok_ids
from rel_support import records as read_records
from support.amqp import drain_sync, total_depth
from support.outbox import RelayProcess, Writer, migrated, published
from support.poll import wait_for
from support.process import apply

from rabbit_retry.outbox import Outbox
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
exchanges:
  rel: {type: topic}
queues:
  rel.orders:
    queue_type: quorum
    bindings: [{exchange: rel, routing_key: orders}]
    retry: {delays: [200ms, 500ms], max_attempts: 4}
  rel.audit:      # nobody consumes it: what the relay published, duplicates included
    queue_type: classic
    bindings: [{exchange: rel, routing_key: orders}]
"""
EVENTS = 3_000  # the kills come at shares of this
AFTER_THE_LAST_KILL = 500  # events written after the last kill, then the stream ends
PREFETCH = 8


def test_outbox_relay_and_idempotent_worker_through_kills_run_each_side_effect_once(
    fresh_vhost: Settings, tmp_path: Path, records: Path, worker_guard: list[Worker],
) -> None:
    started = time.monotonic()
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY)
    apply(fresh_vhost, topology)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    # Bodies rel_consumers reads: {"seq": i, "key": ...} has no "fail": every handler call
    # succeeds and records its side effect under the message id.
    # Writes until stopped (the cap is far beyond it), at most about 330 events a second: the
    # stream goes on past the last kill however late that comes. With 3,000 events and no
    # pause, a loaded 4.0 run saw the worker, restarted after the first kill, handle them all
    # before the second.
    writer = Writer(url, Outbox(topology), 20 * EVENTS, exchange="rel", routing_key="orders",
                    per=10, pause=0.03)
    relay = RelayProcess(fresh_vhost, topology, url, tmp_path / "relay.log",
                         extra=("--batch", "100", "--depth", "4"))
    worker = Worker(fresh_vhost, topology, records, "IdemOrders", sleep_ms=5, prefetch=PREFETCH)
    worker.env["RR_STORE"] = f"sqlite:///{tmp_path / 'keys.db'}"
    worker_guard.append(worker)
    try:
        writer.start()
        wait_for(lambda: writer.written >= EVENTS // 2, "half the events written")
        relay.start()
        worker.start()
        relay_kills = worker_kills = 0
        for share in (0.25, 0.5):
            at_least = int(EVENTS * 6 / 7 * share)
            wait_for(lambda a=at_least: published(url) >= a, f"{at_least} published",
                     interval=0.05)
            relay.kill()
            relay_kills += 1
            relay.start()
        for share in (0.6, 0.8):
            at_least = int(EVENTS * 6 / 7 * share)
            wait_for(lambda a=at_least: len(ok_ids(records)) >= a, f"{at_least} handled",
                     interval=0.05)
            worker.kill()
            worker_kills += 1
            # Counted while no worker runs: the restarted one may finish the stream before
            # the next line reads the count, and that says nothing about where the kill came.
            handled_at_kill = len(ok_ids(records))
            worker.start()
        written_at_kill = writer.written
        wait_for(lambda: writer.written >= written_at_kill + AFTER_THE_LAST_KILL,
                 f"{AFTER_THE_LAST_KILL} events written after the last kill")
        writer.stop()
        writer.join()
        committed = writer.committed
        assert handled_at_kill < len(committed), "the stream ended before the last kill"
        wait_for(lambda: published(url) == len(committed), "all published",
                 within=300)
        wait_for(lambda: committed <= ok_ids(records) and total_depth(
            fresh_vhost, ["rel.orders", "rel.orders.retry.200ms", "rel.orders.retry.500ms"])
            == 0, "every committed event handled", within=300, interval=0.5)
        assert relay.stop() == 0
        worker.stop()
    finally:
        relay.ensure_dead()
    effects = Counter(m for m, _ in read_records(records, "ok"))
    calls = Counter(m for m, _ in read_records(records, "calls"))
    twice = {m: n for m, n in effects.items() if n > 1}
    sent = Counter(c.message_id for c in drain_sync(fresh_vhost, "rel.audit"))
    relay_duplicates = sum(n - 1 for n in sent.values())
    print(f"[reliability] outbox end to end: {len(committed)} committed, "
          f"{len(writer.rolled_back)} rolled back; relay killed {relay_kills}x and published "
          f"{relay_duplicates} events twice; worker killed {worker_kills}x (the last with "
          f"{len(committed) - handled_at_kill} events to go); handler calls "
          f"{sum(calls.values())}, side effects {sum(effects.values())}, twice: {len(twice)}; "
          f"{time.monotonic() - started:.0f}s")
    assert set(sent) == committed  # the relay: every committed event, no other
    assert set(effects) == committed  # every committed event's side effect, no other
    # A side effect twice only from a worker killed between it and its record: never for an
    # event the relay published twice (the consumer's Idempotency took the second as done).
    assert len(twice) <= worker_kills * PREFETCH, twice
