"""Idempotent workers under SIGKILL: two ``rabbit-retry worker`` processes share one store
while the stream carries duplicates and one of them is killed mid-stream, twice. Nothing is
lost, no duplicate is handled twice, and the only repeats are of messages whose handler had
finished when the kill came (the one gap the README names)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from rel_support import Worker, ok_ids, settle, spec_body
from rel_support import records as read_records
from support.amqp import Outgoing, publish_sync
from support.poll import wait_for
from support.process import apply
from support.stores import POSTGRES_URL, REDIS_URL

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
"""
PREFETCH = 8


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "redis"])
def test_two_idempotent_workers_one_killed_twice_lose_nothing_and_run_no_duplicate(
    fresh_vhost: Settings, tmp_path: Path, records: Path, worker_guard: list[Worker], kind: str
) -> None:
    started = time.monotonic()
    store = {
        "sqlite": f"sqlite:///{tmp_path / 'keys.db'}",
        "postgresql": POSTGRES_URL,
        "redis": REDIS_URL,
    }[kind]
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY)
    apply(fresh_vhost, topology)
    run = uuid.uuid4().hex[:6]  # the PostgreSQL and Redis stores outlive the test
    expected: dict[str, str] = {}
    messages: list[Outgoing] = []
    # Long enough that two kills and restarts land mid-stream, however fast the workers are.
    for i in range(1500):
        mid = f"{run}-{i:04d}"
        # A fifth fail once and retry; 150 are published twice, the copy right behind.
        body = spec_body(mid, fail=1) if i % 5 == 4 else spec_body(mid)
        expected[mid] = "ok"
        messages += [Outgoing(mid, body)] * (2 if i < 150 else 1)
    workers = []
    for _ in range(2):
        worker = Worker(fresh_vhost, topology, records, "IdemOrders", sleep_ms=30,
                        prefetch=PREFETCH)
        worker.env["RR_STORE"] = store
        worker_guard.append(worker)
        workers.append(worker.start())
    publish_sync(fresh_vhost, messages, exchange="rel", routing_key="orders")
    victim = workers[0]
    kills = 0
    for threshold in (100, 250):
        wait_for(lambda t=threshold: len(ok_ids(records)) >= t, f"{threshold} successes")
        victim.kill()
        kills += 1
        handled_at_kill = len(ok_ids(records))  # before the restart: see the outbox's test
        victim.start()
    assert handled_at_kill < len(expected), "the stream ended before the last kill"
    ledger = settle(fresh_vhost, workers[1], expected, ["rel.orders", "rel.orders.retry.200ms",
                    "rel.orders.retry.500ms"], ["rel.orders.parking"], within=180)
    victim.stop()
    handled = Counter(m for m, _ in read_records(records, "ok"))
    repeats = {m: n for m, n in handled.items() if n > 1}
    print(f"[reliability] idempotent workers ({kind}): {len(messages)} published, "
          f"{len(expected)} distinct; SIGKILLs {kills}; handled twice: {len(repeats)}; "
          f"{time.monotonic() - started:.1f}s")
    ledger.check(f"idempotent workers ({kind})", started)
    assert set(handled) == set(expected)
    # The duplicates published (150) never ran twice; a repeat can only be a message whose
    # handler had finished, in the killed worker, before the store recorded it.
    assert len(repeats) <= kills * PREFETCH, repeats
