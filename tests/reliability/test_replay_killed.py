"""``rabbit-retry parking replay`` SIGKILLed midway, twice, with a worker consuming what it
replays: every parked message ends handled, none is left parked or lost.

tests/integration/test_parking_process.py kills one replay of 60 hand-parked messages and reads
the queues back; this one parks 300 through the real worker, kills two replays at different
points, finishes with a third, and counts successes recorded by the worker's handler.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from rel_support import Worker, ok_ids, settle, spec_body
from support.amqp import Outgoing, depth_sync, publish_sync
from support.poll import wait_for
from support.process import CLI, apply, cli

from rabbit_retry.settings import Settings

Q = "rel.orders"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    retry: {{delays: [200ms, 400ms], max_attempts: 3}}
"""
COUNT = 300


def test_replay_killed_twice_midway_then_finished_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, records: Path
) -> None:
    started = time.monotonic()
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY)
    apply(fresh_vhost, topology)
    worker = Worker(fresh_vhost, topology, records, "Orders", prefetch=10)
    try:
        worker.start()
        ids = [f"r-{i:04d}" for i in range(COUNT)]
        publish_sync(fresh_vhost, [Outgoing(m, spec_body(m, fixable=True)) for m in ids],
                routing_key=Q)
        wait_for(lambda: depth_sync(fresh_vhost, f"{Q}.parking") == COUNT, "everything parked")
        (records / "fixed").touch()  # the cause is fixed: a replayed message now succeeds

        kills = []
        for threshold in (COUNT // 5, COUNT // 2):
            replay = subprocess.Popen(
                [CLI, "--url", fresh_vhost.url, "--management-url", fresh_vhost.management_url,
                 "parking", "replay", Q, "--yes", "--rate", "150"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            try:
                wait_for(lambda t=threshold, r=replay: len(ok_ids(records)) >= t
                         or r.poll() is not None, f"{threshold} replayed messages handled")
            finally:
                replay.send_signal(signal.SIGKILL)
                out, err = replay.communicate(timeout=30)
            assert replay.returncode == -signal.SIGKILL, (out, err)
            assert b"replayed" not in out, "the replay finished before it was killed"
            kills.append(len(ok_ids(records)))
        # The broker requeues what each killed replay held; a last replay moves the rest.
        wait_for(lambda: (depth_sync(fresh_vhost, f"{Q}.parking") or 0) + len(ok_ids(records))
                 >= COUNT, "the killed replays' messages back in the parking queue")
        last = cli(fresh_vhost, "parking", "replay", Q, "--yes")
        assert last.code == 0, last.err
        assert last.out.startswith("replayed "), last.out
        assert last.out.rstrip().endswith("; 0 left parked"), last.out
        ledger = settle(fresh_vhost, worker, dict.fromkeys(ids, "ok"),
                        [Q, f"{Q}.retry.200ms", f"{Q}.retry.400ms"], [f"{Q}.parking"])
    finally:
        worker.ensure_dead()
    print(f"[reliability] replay killed after {kills} handled; last run: {last.out.strip()}")
    ledger.check("parking replay killed midway", started)
