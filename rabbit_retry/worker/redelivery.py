"""How each RabbitMQ version counts a message's returns, and what the worker concludes (pure).

Every piece of version knowledge about redeliveries lives here; docs/versions.md says how each
fact was verified and tests/unit/fixtures/deliveries-*.json holds what real brokers sent.

A *return* is a delivery that came back to its queue without a verdict: the consumer's channel
or connection closed with it unacked (a crash, a lost network, a shutdown past its grace), or a
client requeued it. Quorum queues count returns in the ``x-delivery-count`` header and, once the
count passes the queue's delivery limit, dead-letter the message with reason ``delivery_limit``.
What ``x-delivery-count`` counts, by version (seen on 3.10.8, 4.0.5 and 4.3.6):

============================  =========  ============  ==========
event                         3.10-3.13  4.0-4.2       4.3+
============================  =========  ============  ==========
channel closed, unacked       +1         +1            +1
``basic.reject(requeue)``     +1         +1            +1
``basic.nack(requeue)``       +1         +1            +0 [#]_
dead-letter cycle (``nack``   reset to   +1, and kept  kept as it
then a tier's TTL)            0          across it     was
default delivery limit        none       20            20
============================  =========  ============  ==========

.. [#] 4.3 counts it in ``x-acquired-count`` instead, which no limit reads.

Two conclusions the worker relies on (``decide`` applies them to a delivery's ``history``):

1. ``x-delivery-count`` is, on every version, the number the broker compares with the limit
   (returns beyond the limit dead-letter the message), so "one more return and the broker acts"
   is ``count >= limit`` everywhere.
2. Only a message a client publishes afresh starts from zero on 4.x. So the broker's own
   ``nack`` cycle (native retry) is used only where it leaves the count at zero: always on 3.x,
   never on 4.0-4.2 (the cycle itself adds one and marks the message redelivered), and on 4.3+
   only from a count of zero. Everywhere else the worker retries with a confirmed copy, whose
   count starts at zero; otherwise a message's returns of one attempt would be charged again to
   the next one.

Classic queues count nothing (no header, no limit); only the ``redelivered`` flag says that a
delivery came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry.contract import as_text

X_DELIVERY_LIMIT = "x-delivery-limit"  # a queue argument, not a header

# Returns the worker allows a message where the broker sets no limit (3.x quorum queues still
# count them): a crash loop ends there too, as on 4.x by default.
WORKER_RETURN_LIMIT = 20


@dataclass(frozen=True, slots=True)
class Counting:
    """How one broker version counts returns (see the module's table)."""

    version: tuple[int, int]
    default_limit: int | None  # a quorum queue's delivery limit when none is set
    native_cycle: str  # what a nack cycle does to the count: "reset" | "adds" | "keeps"
    requeue_counts: bool  # basic.nack(requeue=True) adds to x-delivery-count

    @property
    def label(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def parse_version(version: object) -> tuple[int, int] | None:
    """``(major, minor)`` of a server's ``version`` property (``"3.10.8"``, ``b"4.3.6"``)."""
    text = as_text(version)
    if text is None:
        return None
    parts = text.strip().split(".")
    if len(parts) < 2 or not all(p.isascii() and p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def counting(version: object) -> Counting:
    """The counting rules of the broker that reported ``version``.

    An unreadable version is taken as the newest behaviour we know: it is the one a broker we
    cannot identify is most likely to have, and it still never lets a limit pass unseen.
    """
    parsed = parse_version(version) or (4, 3)
    if parsed < (4, 0):
        return Counting(parsed, None, "reset", requeue_counts=True)
    if parsed < (4, 3):
        return Counting(parsed, 20, "adds", requeue_counts=True)
    return Counting(parsed, 20, "keeps", requeue_counts=False)


def with_policy_limit(
    arguments: Mapping[str, Any], policy: Mapping[str, Any]
) -> Mapping[str, Any]:
    """``arguments`` with the file's policy ``delivery-limit`` folded in: where both set one,
    the broker applies the lower."""
    limit = policy.get("delivery-limit")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return arguments
    current = arguments.get(X_DELIVERY_LIMIT)
    if isinstance(current, int) and not isinstance(current, bool) and 0 < current < limit:
        return arguments
    return {**arguments, X_DELIVERY_LIMIT: limit}


def delivery_limit(
    queue_type: str, arguments: Mapping[str, Any], rules: Counting
) -> int | None:
    """Returns a delivery of the queue may come back from before the worker counts them as one
    failed attempt (one return short of the broker dead-lettering it with reason
    ``delivery_limit``); None when the worker cannot count returns or must not stop them.

    Classic queues count nothing. A quorum queue's ``x-delivery-limit`` argument wins (below 1,
    such as 4.x's -1 for "unlimited", is the user's choice of no limit); without one, the
    version's default applies, or ``WORKER_RETURN_LIMIT`` where the broker has none. A limit
    set by a policy is visible only when it is the file's own (``with_policy_limit``).
    """
    if queue_type != "quorum":
        return None
    if X_DELIVERY_LIMIT in arguments:
        value = arguments[X_DELIVERY_LIMIT]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        return value
    return rules.default_limit if rules.default_limit is not None else WORKER_RETURN_LIMIT
