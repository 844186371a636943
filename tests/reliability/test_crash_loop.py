"""A poison message that kills its worker process on every delivery ends parked, alone.

The worker runs as a real process, restarted whenever it dies (as systemd or Kubernetes would).
The poison message's handler sleeps briefly and then ``os._exit``\\ s, so the first crash happens
with other deliveries in flight beside it: the broker counts a return on each of them. The
innocent ones must all be handled and none parked; the poison one is counted one failed attempt
per delivery limit's worth of crashes, and parked ``exhausted``. Both with a small
``x-delivery-limit`` in the file and with the broker's own default (20 on 4.x; on 3.x, which has
none, the worker's own 20); and on a classic queue, which counts no returns at all: the worker
counts them on the copy that sends a returned delivery back (``return-count``), up to its 20.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rel_support import Worker, ok_ids, spec_body
from rel_support import records as recorded
from support.amqp import Outgoing, depth_sync, drain_sync, publish_sync
from support.poll import wait_for
from support.process import apply

from rabbit_retry.settings import Settings

INNOCENT = 20
PREFETCH = 10



@pytest.mark.parametrize(
    ("queue_type", "limit", "max_attempts", "crashes_per_attempt"),
    [("quorum", 3, 2, 3), ("quorum", None, 1, 20), ("classic", None, 1, 20)],
    ids=["x-delivery-limit-3", "broker-default-limit", "classic"],
)
def test_a_crash_looping_message_is_parked_alone(
    fresh_vhost: Settings, tmp_path: Path, records: Path, worker_guard: list[Worker],
    queue_type: str, limit: int | None, max_attempts: int, crashes_per_attempt: int,
) -> None:
    arguments = f"\n    arguments: {{x-delivery-limit: {limit}}}" if limit else ""
    topology = tmp_path / "crash.yml"
    topology.write_text(
        f"version: 1\nqueues:\n  rel.orders:\n    queue_type: {queue_type}\n"
        f"    retry: {{delays: [200ms], max_attempts: {max_attempts}}}{arguments}\n"
    )
    apply(fresh_vhost, topology)
    # Innocent messages first, each taking a second, so the worker is in the middle of several
    # of them when the poison one kills it.
    innocents = [Outgoing(f"i-{n}", spec_body(f"i-{n}")) for n in range(INNOCENT)]
    poison = Outgoing("poison", spec_body("poison", crash=300))
    publish_sync(fresh_vhost, [*innocents[:PREFETCH - 1], poison, *innocents[PREFETCH - 1:]],
            routing_key="rel.orders")

    worker = Worker(fresh_vhost, topology, records, "Orders", sleep_ms=1000,
                    prefetch=PREFETCH)
    worker_guard.append(worker)
    expected_crashes = crashes_per_attempt * max_attempts

    def settled() -> bool:
        if worker.exited():
            assert worker.starts <= expected_crashes + 1, (
                f"{worker.starts} starts: the poison message was not taken at its limit\n"
                + worker.log()[-3000:]
            )
            worker.start()  # as a supervisor would
        parked = depth_sync(fresh_vhost, "rel.orders.parking") or 0
        assert parked <= 1, f"{parked} messages parked: innocent ones were blamed for the crash"
        return parked == 1 and len(ok_ids(records)) == INNOCENT

    worker.start()
    wait_for(settled, "every innocent message handled and the poison one parked", within=240)
    worker.stop()

    calls = recorded(records, "calls")
    poison_calls = [attempt for message_id, attempt in calls if message_id == "poison"]
    expected_calls = [a for a in range(1, max_attempts + 1) for _ in range(crashes_per_attempt)]
    assert poison_calls == expected_calls
    assert worker.starts == expected_crashes + 1
    # The positive control: the first crash really took innocent deliveries down with it.
    in_flight = _in_flight_at_first_crash(records)
    print(f"innocent deliveries in flight at the first crash: {sorted(in_flight)}")
    assert in_flight, "the poison message crashed the worker with no other delivery in flight"

    assert depth_sync(fresh_vhost, "rel.orders") == 0
    assert depth_sync(fresh_vhost, "rel.orders.retry.200ms") == 0
    [parked] = drain_sync(fresh_vhost, "rel.orders.parking")
    assert parked.message_id == "poison"
    assert parked.headers["parked-reason"] == "exhausted"
    assert parked.headers["exception-type"] == "rabbit_retry.worker.DeliveryLimitReached"
    assert parked.headers["retry-count"] == max_attempts
    assert ok_ids(records) == {m.message_id for m in innocents}


def _in_flight_at_first_crash(directory: Path) -> set[str]:
    """Innocent messages the first worker process started and did not finish before it died."""

    def by_pid(kind: str) -> list[tuple[str, str]]:
        path = directory / kind
        lines = path.read_text().splitlines() if path.exists() else []
        return [(line.split(" ")[0], line.split(" ")[2]) for line in lines]

    calls = by_pid("calls")
    first_pid = calls[0][1]
    started = {m for m, pid in calls if pid == first_pid and m != "poison"}
    return started - {m for m, pid in by_pid("ok") if pid == first_pid}
