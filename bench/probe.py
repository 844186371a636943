"""What a consumer under test records about itself: first and last completion, latencies, failures.

Imported inside every measured consumer process (ours, the bare loops, Dramatiq, FastStream), so
it uses the standard library only: whatever it imports would count against that process's RSS.
Configured through environment variables so the same code serves a CLI worker and a script:

- ``BENCH_N``: completions (or, with ``BENCH_FAIL=always``, failures) that end the measurement;
- ``BENCH_OUT``: where the JSON result is written, atomically, once that count is reached;
- ``BENCH_FAIL``: ``none`` | ``once`` (every message fails once) | ``flagged`` (messages whose body
  says ``"fail": true`` fail once) | ``always``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

# The queue every benchmark consumes (each measurement has a vhost of its own).
QUEUE = "bench.work"


class Probe:
    """Thread-safe: Dramatiq calls it from worker threads, the asyncio consumers from one loop."""

    def __init__(self, target: int, out: str, fail: str = "none") -> None:
        self.target = target
        self.out = out
        self.fail = fail
        self.first: float | None = None
        self.last: float | None = None
        self.completed = 0
        self.failures = 0
        self.calls = 0
        self.latencies: list[float] = []
        self._failed_ids: set[object] = set()
        self._lock = threading.Lock()
        self._written = False

    @classmethod
    def from_env(cls) -> Probe:
        return cls(
            int(os.environ.get("BENCH_N", "0")),
            os.environ.get("BENCH_OUT", ""),
            os.environ.get("BENCH_FAIL", "none"),
        )

    def should_fail(self, message_id: object, flagged: bool = False) -> bool:
        """Counts one handler call and says whether this call must fail (by the fail rule)."""
        now = time.time()
        with self._lock:
            self.calls += 1
            if self.first is None:
                self.first = now
            if self.fail == "always":
                fail = True
            elif self.fail == "once" or (self.fail == "flagged" and flagged):
                fail = message_id not in self._failed_ids
                if fail:
                    self._failed_ids.add(message_id)
            else:
                fail = False
            if fail:
                self.failures += 1
                if self.fail == "always" and self.failures == self.target:
                    self.last = now
                    self._write()
        return fail

    def done(self, published_at: float | None = None) -> None:
        """One message handled successfully (counted before its ack, the same for every peer)."""
        now = time.time()
        with self._lock:
            if self.first is None:
                self.first = now
            self.completed += 1
            if published_at is not None:
                self.latencies.append(now - published_at)
            if self.completed == self.target and self.fail != "always":
                self.last = now
                self._write()

    def result(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "last": self.last,
            "completed": self.completed,
            "failures": self.failures,
            "calls": self.calls,
            "latencies": self.latencies,
            "pid": os.getpid(),
        }

    def _write(self) -> None:
        if self._written or not self.out:
            return
        self._written = True
        tmp = self.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.result(), fh)
        os.replace(tmp, self.out)


_probe: Probe | None = None


def probe() -> Probe:
    """The process's probe, made on first use from the environment."""
    global _probe
    if _probe is None:
        _probe = Probe.from_env()
    return _probe


def message_body(index: int, fail: bool = False) -> dict[str, Any]:
    """The body every benchmark publishes: an id, the publish time, and the fail flag."""
    return {"id": index, "t": time.time(), "fail": fail}
