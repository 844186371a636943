"""What became of a replay's copies: parked again (exact: they come back carrying its id), still
on their way (at most what the target queue, its retry tiers and its parking queue hold now),
and succeeded (the rest: handled, and not parked since).

Only parks come back to the desk; a success leaves no trace. So ``pending`` is an upper bound
read from the broker's queue depths (the management API) and ``succeeded`` a lower bound; once
the target's queues are empty, both are exact. Without the management API both are None.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology, naming

log = logging.getLogger("rabbit_retry.desk")

DEPTHS_TTL_S = 5.0


@dataclass(frozen=True, slots=True)
class Outcome:
    sent: int  # copies the broker confirmed
    parked_again: int
    pending: int | None
    succeeded: int | None

    def to_json(self) -> dict[str, Any]:
        return {"sent": self.sent, "parked_again": self.parked_again, "pending": self.pending,
                "succeeded": self.succeeded}


def outcome(sent: int, parked_again: int, depth: int | None) -> Outcome:
    """A replay's outcome (pure): ``depth`` is what its target's queues hold now (None:
    unknown)."""
    parked_again = min(parked_again, sent)
    if depth is None:
        return Outcome(sent, parked_again, None, None)
    pending = min(sent - parked_again, max(depth, 0))
    return Outcome(sent, parked_again, pending, sent - parked_again - pending)


class Depths:
    """The messages (ready and unacked) in each queue a replay's copy can be in: the queue, its
    retry tiers, its parking queue; read from the management API, kept a few seconds."""

    def __init__(self, settings: Settings, topology: Topology) -> None:
        self.settings = settings
        self.watched: dict[str, tuple[str, ...]] = {
            q.name: (q.name, *(naming.tier_queue(q.name, d) for d in q.retry.tiers_ms),
                     naming.parking_queue(q.name))
            for q in topology.queues
        }
        self._read_at = -DEPTHS_TTL_S
        self._depths: Mapping[str, int] | None = None

    def depth(self, queue: str) -> int | None:
        """What ``queue``'s queues hold now; None when the broker cannot tell (or it is not a
        queue of the topology). Blocking: call it from a thread."""
        if queue not in self.watched:
            return None
        depths = self._read()
        if depths is None:
            return None
        return sum(depths.get(name, 0) for name in self.watched[queue])

    def _read(self) -> Mapping[str, int] | None:
        if time.monotonic() - self._read_at < DEPTHS_TTL_S:
            return self._depths
        from rabbit_retry.broker.management import Management

        try:
            with Management.for_settings(self.settings, timeout=5.0) as api:
                listed = api.queues(self.settings.vhost)
            self._depths = {str(q["name"]): int(q.get("messages") or 0) for q in listed}
        except Exception as exc:  # the management API is optional to the desk
            log.info("desk: queue depths unavailable (%s): replay outcomes show no pending",
                     str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self._depths = None
        self._read_at = time.monotonic()
        return self._depths
