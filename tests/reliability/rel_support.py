"""Helpers of the reliability suite (no tests here): the worker as a real ``rabbit-retry worker``
process running ``rel_consumers``, what it recorded, and the conservation ledger every fault test
ends with. Publishing, depths, waiting and the command line come from ``tests/support``.

Every wait is "until something happens, within a generous deadline"; nothing asserts how long
anything took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.amqp import Outgoing, drain_sync, total_depth
from support.poll import DEADLINE_S, wait_for
from support.process import CLI

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

HERE = Path(__file__).resolve().parent
WORKER_CONNECTION = "rabbit-retry worker"


# --- the worker ------------------------------------------------------------------------------


class Worker:
    """``rabbit-retry worker rel_consumers:CLASS ... -t FILE`` in its own process.

    Each start appends to one log file, so the log of a test covers every restart.
    """

    def __init__(self, settings: Settings, topology: Path, records: Path, *classes: str,
                 sleep_ms: int = 0, prefetch: int = 10, grace: float = 10.0,
                 log_name: str = "worker.log") -> None:
        self.settings = settings
        self.topology = topology
        self.records = records
        self.classes = classes
        self.log_path = records / log_name
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "RR_RECORD_DIR": str(records),
            "RR_SLEEP_MS": str(sleep_ms),
            "RR_PREFETCH": str(prefetch),
        }
        self.grace = grace
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *, consuming: bool = True) -> Worker:
        """Starts the process and, unless ``consuming`` is False, waits until it consumes."""
        assert self.process is None or self.process.poll() is not None, "already running"
        consuming_before = self.log().count("consuming queue=")
        argv = [CLI, "--url", self.settings.url_list, "worker",
                *(f"rel_consumers:{c}" for c in self.classes),
                "-t", str(self.topology), "--grace", str(self.grace)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                cwd=self.records,
            )
        self.starts += 1
        if not consuming:
            return self
        wanted = consuming_before + len(self.classes)
        wait_for(lambda: self.log().count("consuming queue=") >= wanted or self.exited(),
                 "the worker to consume")
        assert not self.exited(), f"the worker exited at start:\n{self.log()[-3000:]}"
        return self

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: no goodbye to the broker, whatever was in flight stays unacked."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, as a deployment stops it: must exit 0."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=self.grace + 60)
        assert code == 0, f"the worker exited {code}:\n{self.log()[-3000:]}"

    def ensure_dead(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def log(self) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


# --- what the broker and the worker did -------------------------------------------------------


def spec_body(message_id: str, **behaviour: Any) -> bytes:
    """A body for ``rel_consumers``: what the handler does with this message."""
    return json.dumps({"id": message_id, **behaviour}).encode()


def worker_connections(api: Management, settings: Settings) -> list[str]:
    return [
        c["name"]
        for c in api.connections(settings.vhost)
        if (c.get("client_properties") or {}).get("connection_name") == WORKER_CONNECTION
    ]


def queue_info(api: Management, settings: Settings, queue: str) -> dict[str, Any]:
    info = api.queue(settings.vhost, queue)
    assert info is not None, queue
    return info


def channel_publishes(api: Management, settings: Settings) -> int:
    """Publishes the broker counted on the channels open in the vhost now (statistics: up to 5 s
    behind). While a test watches a worker, its channels are the only long-lived ones; the
    vhost-wide counter is not used because it also depends on the statistics of the test's own
    short-lived publishing channels having been collected before they closed."""
    channels = api.get(f"/vhosts/{settings.vhost}/channels")
    return sum(int((ch.get("message_stats") or {}).get("publish", 0)) for ch in channels)


# --- the ledger ------------------------------------------------------------------------------


def records(directory: Path, kind: str) -> list[tuple[str, int]]:
    """(message id, attempt) per line of the ``kind`` record the consumers write."""
    path = directory / kind
    if not path.exists():
        return []
    out = []
    # A line a consumer is writing at this moment can be read in part (seen on 3.10 under load):
    # only lines ended by their newline are complete.
    for line in path.read_text().split("\n")[:-1]:
        message_id, attempt, _pid = line.split(" ")
        out.append((message_id, int(attempt)))
    return out


def ok_ids(directory: Path) -> set[str]:
    return {m for m, _ in records(directory, "ok")}


@dataclass
class Ledger:
    """Where every published message ended. ``expected`` maps id -> "ok" or a park reason."""

    expected: dict[str, str]
    succeeded: Counter[str] = field(default_factory=Counter)
    parked: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, set[str]] = field(default_factory=dict)
    left: int = 0  # messages still in the main queues or tiers at the end

    @property
    def losses(self) -> list[str]:
        return sorted(m for m in self.expected if m not in self.succeeded and m not in self.parked)

    @property
    def duplicates(self) -> int:
        counts = [*self.succeeded.values(), *self.parked.values()]
        return sum(n - 1 for n in counts)

    @property
    def misplaced(self) -> list[str]:
        """Ids that ended somewhere else than expected: a transient failure parked, a park with
        the wrong reason, a permanent failure that succeeded, or an id nobody published."""
        wrong = []
        for m in set(self.succeeded) | set(self.parked):
            want = self.expected.get(m)
            if want is None:
                wrong.append(f"{m}: never published")
            elif want == "ok" and m in self.parked:
                wrong.append(f"{m}: parked {sorted(self.reasons[m])}, expected to succeed")
            elif want != "ok" and m in self.succeeded:
                wrong.append(f"{m}: succeeded, expected parked {want}")
            elif want != "ok" and self.reasons.get(m, {want}) != {want}:
                wrong.append(f"{m}: parked {sorted(self.reasons[m])}, expected {want}")
        return sorted(wrong)

    def summary(self, name: str, started: float) -> str:
        return (
            f"[reliability] {name}: {len(self.expected)} messages, "
            f"{sum(1 for v in self.expected.values() if v == 'ok')} to succeed, "
            f"{sum(1 for v in self.expected.values() if v != 'ok')} to park; "
            f"losses {len(self.losses)}, duplicates {self.duplicates}, "
            f"misplaced {len(self.misplaced)}, left {self.left}; "
            f"{time.monotonic() - started:.1f}s"
        )

    def check(self, name: str, started: float) -> None:
        print(self.summary(name, started))
        assert self.losses == [], f"lost: {self.losses}"
        assert self.misplaced == []
        assert self.left == 0


def settle(settings: Settings, worker: Worker | Sequence[Worker], expected: Mapping[str, str],
           queues: Sequence[str], parking: Sequence[str], *, within: float = DEADLINE_S) -> Ledger:
    """Wait until every expected success is recorded, as many messages are parked as expected
    and ``queues`` (main queues and tiers) stay empty with no new handler calls; stop the worker
    (or every worker: they share one record directory) with SIGTERM; count what is left and
    take what was parked."""
    workers = [worker] if isinstance(worker, Worker) else list(worker)
    worker = workers[0]
    want_ok = {m for m, v in expected.items() if v == "ok"}
    want_parked = sum(1 for v in expected.values() if v != "ok")
    state: dict[str, Any] = {"calls": -1, "quiet": 0}

    def quiescent() -> bool:
        calls = len(records(worker.records, "calls"))
        done = (
            want_ok <= ok_ids(worker.records)
            and total_depth(settings, parking) >= want_parked
            and total_depth(settings, queues) == 0
        )
        if done and calls == state["calls"]:
            state["quiet"] += 1
        else:
            state["quiet"] = 0
        state["calls"] = calls
        # Three quiet polls, a second apart: longer than any tier, so a duplicate still on its
        # way round the retry loop shows up as a call or a queued message.
        return bool(state["quiet"] >= 3)

    try:
        wait_for(quiescent, "every message to settle", within=within, interval=1.0)
    except AssertionError:
        for each in workers:
            print(each.log()[-4000:])
        missing = sorted(want_ok - ok_ids(worker.records))
        print(f"[settle] {len(missing)} expected successes missing (first: {missing[:10]}); "
              f"parked {total_depth(settings, parking)} of {want_parked} expected")
        print(_counts(settings, [*queues, *parking]))
        raise
    for each in workers:
        each.stop()
    ledger = Ledger(dict(expected))
    ledger.succeeded.update(m for m, _ in records(worker.records, "ok"))
    ledger.left = total_depth(settings, queues)
    for queue in parking:
        for message in drain_sync(settings, queue):
            assert message.message_id is not None
            ledger.parked[message.message_id] += 1
            reason = message.headers.get("parked-reason")
            ledger.reasons.setdefault(message.message_id, set()).add(str(reason))
    return ledger


def mixed_stream(prefix: str, count: int) -> tuple[list[Outgoing], dict[str, str]]:
    """``count`` messages: about 60% succeed at once, 25% fail transiently once or twice, 15%
    are declined for good (``Permanent``), interleaved."""
    messages, expected = [], {}
    for i in range(count):
        mid = f"{prefix}-{i:04d}"
        slot = i % 20
        if slot < 12:
            body, outcome = spec_body(mid), "ok"
        elif slot < 17:
            body, outcome = spec_body(mid, fail=1 + slot % 2), "ok"
        else:
            body, outcome = spec_body(mid, permanent=True), "permanent"
        messages.append(Outgoing(mid, body))
        expected[mid] = outcome
    return messages, expected


def _counts(settings: Settings, queues: Sequence[str]) -> str:
    """What the broker says each queue holds (a failing settle prints it): ready, unacked, and
    what a quorum queue keeps to dead-letter (``messages_dlx``)."""
    keys = ("messages", "messages_ready", "messages_unacknowledged", "messages_dlx", "consumers")
    with Management.for_settings(settings) as api:
        lines = []
        for name in queues:
            info = api.queue(settings.vhost, name) or {}
            lines.append(f"[settle] {name}: " + ", ".join(f"{k}={info.get(k)}" for k in keys))
    return "\n".join(lines)
