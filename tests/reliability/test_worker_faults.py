"""The worker under faults, every message counted: SIGKILLed mid-stream and restarted, its
connection closed by the broker, and the broker application stopped and started.

Each test publishes a mixed stream (successes, transient failures that retry through the tiers,
``Permanent`` failures that park), injects its fault several times while the stream is being
worked, and ends with the conservation check of ``rel_support.settle``: every message succeeded
or is parked with its expected reason, none is left behind, duplicates are counted and printed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from rel_support import Worker, mixed_stream, ok_ids, settle, worker_connections
from support.amqp import publish_sync
from support.broker import restart_app
from support.poll import wait_for
from support.process import apply

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
exchanges:
  rel: {type: topic}
queues:
  rel.orders:
    queue_type: %(orders_type)s
    bindings: [{exchange: rel, routing_key: orders}]
    retry: {delays: [200ms, 500ms], max_attempts: 4}
  rel.payments:
    queue_type: %(payments_type)s
    bindings: [{exchange: rel, routing_key: payments}]
    retry: {delays: [300ms], max_attempts: 3}
"""
MAIN_AND_TIERS = ["rel.orders", "rel.orders.retry.200ms", "rel.orders.retry.500ms",
                  "rel.payments", "rel.payments.retry.300ms"]
PARKING = ["rel.orders.parking", "rel.payments.parking"]


def _setup(settings: Settings, tmp_path: Path, orders_type: str, payments_type: str,
           orders: int, payments: int) -> tuple[Path, dict[str, str]]:
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY % {"orders_type": orders_type, "payments_type": payments_type})
    apply(settings, topology)
    o_messages, expected = mixed_stream("o", orders)
    p_messages, p_expected = mixed_stream("p", payments)
    expected.update(p_expected)
    publish_sync(settings, o_messages, exchange="rel", routing_key="orders")
    publish_sync(settings, p_messages, exchange="rel", routing_key="payments")
    return topology, expected



def _thresholds(expected: dict[str, str], fractions: tuple[float, ...]) -> list[int]:
    to_succeed = sum(1 for v in expected.values() if v == "ok")
    return [int(to_succeed * f) for f in fractions]


def test_worker_sigkilled_mid_stream_and_restarted_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, records: Path, worker_guard: list[Worker]
) -> None:
    started = time.monotonic()
    # rel.orders: quorum, two tiers (confirmed copies); rel.payments: quorum, one tier (native
    # nack, the broker dead-letters at-least-once).
    topology, expected = _setup(fresh_vhost, tmp_path, "quorum", "quorum", 300, 200)
    worker = Worker(fresh_vhost, topology, records, "Orders", "Payments", sleep_ms=40,
                    prefetch=8)
    worker_guard.append(worker)
    worker.start()
    kills = 0
    for threshold in _thresholds(expected, (0.15, 0.35, 0.55, 0.75)):
        wait_for(lambda t=threshold: len(ok_ids(records)) >= t, f"{threshold} successes")
        worker.kill()
        kills += 1
        handled_at_kill = len(ok_ids(records))  # before the restart, which may end the stream
        worker.start()
    assert handled_at_kill < sum(1 for v in expected.values() if v == "ok"), (
        "the stream finished before the last kill; slow the handler down"
    )
    ledger = settle(fresh_vhost, worker, expected, MAIN_AND_TIERS, PARKING)
    print(f"[reliability] SIGKILLs: {kills}, worker starts: {worker.starts}")
    ledger.check("worker SIGKILLed mid-stream", started)


def test_connection_closed_by_the_broker_reconnects_by_itself_and_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, records: Path, management: Management,
    worker_guard: list[Worker],
) -> None:
    started = time.monotonic()
    # rel.orders classic with two tiers, rel.payments quorum with one (native nack).
    topology, expected = _setup(fresh_vhost, tmp_path, "classic", "quorum", 200, 150)
    worker = Worker(fresh_vhost, topology, records, "Orders", "Payments", sleep_ms=40,
                    prefetch=8)
    worker_guard.append(worker)
    worker.start()
    pid = worker.pid
    closed: list[str] = []
    for threshold in _thresholds(expected, (0.2, 0.45, 0.7)):
        wait_for(lambda t=threshold: len(ok_ids(records)) >= t, f"{threshold} successes")
        # The connection the worker opened after the previous close (the statistics list a
        # new connection within a few seconds; a closed one may linger in the list a moment).
        names = wait_for(
            lambda: [n for n in worker_connections(management, fresh_vhost) if n not in closed],
            "the worker's current connection",
        )
        for name in names:
            management.close_connection(name, reason="reliability test")
            closed.append(name)
        outages = len(closed)
        wait_for(lambda n=outages: worker.log().count("reconnected after") >= n,
                 "the worker to reconnect")
    assert not worker.exited() and worker.pid == pid, "the worker must reconnect by itself"
    assert worker.starts == 1
    ledger = settle(fresh_vhost, worker, expected, MAIN_AND_TIERS, PARKING)
    log = worker.log()
    outages = len(closed)
    lost = log.count("lost the broker")
    back = log.count("reconnected after")
    retrying = log.count("still reconnecting")
    print(f"[reliability] broker-side closes: {outages}; log: {lost} 'lost the broker', "
          f"{back} 'reconnected after', {retrying} 'still reconnecting'")
    # Once per outage, not a line per attempt or per in-flight message.
    assert (lost, back) == (outages, outages), log[-3000:]
    assert retrying <= outages
    assert "CONNECTION_FORCED" in log and "reliability test" in log
    assert "Traceback" not in log
    ledger.check("connection closed by the broker", started)


def test_broker_app_stopped_and_started_mid_stream_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, records: Path, management: Management,
    worker_guard: list[Worker],
) -> None:
    """The shared broker goes down for a few seconds; ``finally`` always brings it back."""
    started = time.monotonic()
    # Durable queues, persistent messages: rel.orders quorum with two tiers, rel.payments
    # classic with one (a classic queue always takes the confirmed-copy path).
    topology, expected = _setup(fresh_vhost, tmp_path, "quorum", "classic", 200, 150)
    worker = Worker(fresh_vhost, topology, records, "Orders", "Payments", sleep_ms=40,
                    prefetch=8)
    worker_guard.append(worker)
    worker.start()
    pid = worker.pid
    threshold = _thresholds(expected, (0.3,))[0]
    wait_for(lambda: len(ok_ids(records)) >= threshold, f"{threshold} successes")
    stopped_at = time.monotonic()
    restart_app(management)
    outage = time.monotonic() - stopped_at
    wait_for(lambda: "reconnected after" in worker.log(), "the worker to reconnect", within=180)
    assert not worker.exited() and worker.pid == pid, "the worker must reconnect by itself"
    # Past the broker's own retry of a dead-letter it could not deliver (180 s): one CI run on
    # 4.3 had not settled 180 s after the restart (cause not found; a failing settle now prints
    # what each queue holds; 240 s, so that it fails before pytest-timeout's 300 s stops the
    # test without it, as it did on 4.3 on 2026-11-30).
    ledger = settle(fresh_vhost, worker, expected, MAIN_AND_TIERS, PARKING, within=240)
    log = worker.log()
    lost = log.count("lost the broker")
    reconnected = re.findall(r"reconnected after ([\d.]+)s \((\d+) attempt", log)
    print(f"[reliability] broker app down {outage:.1f}s; log: {lost} 'lost the broker', "
          f"reconnected {reconnected}, {log.count('still reconnecting')} 'still reconnecting'")
    assert lost == 1 and len(reconnected) == 1, log[-3000:]
    assert "Traceback" not in log
    ledger.check("broker app stopped and started", started)
