"""What a main queue's length limit and message TTL do to a message, as the file must say it
(README, "Length limits and TTLs"); pure.

RabbitMQ dead-letters a message that overflows a full classic queue (``drop-head``) or expires
in any queue through the queue's dead-letter exchange, which for ``Q`` is ``Q.retry`` with
routing key ``Q``. Routed to a retry tier, such a message comes back to ``Q`` by dead-lettering
alone, and the broker breaks that cycle by dropping it (``Dead-letter queues cycle detected``,
on 3.10, 4.0 and 4.3 alike). So a limit or a TTL is accepted only with the file's word on what
happens: ``on_full`` / ``on_expire``. ``park`` routes ``Q``'s dead letters to ``Q.parking``
(``QueueConfig.dead_letter_route``); ``drop`` leaves them no route; ``reject`` refuses new
publishes (publisher confirms get a ``nack``).

Why some combinations are refused (each checked on 3.10, 4.0 and 4.3):
- ``reject`` on a classic queue: ``reject-publish`` refuses the retried messages coming back
  from a tier as well, and a classic tier dead-letters at most once: they are dropped.
  A quorum tier dead-letters at least once, and a full quorum queue takes its returns.
- ``park`` / ``drop`` on a quorum queue's length: quorum queues always ``reject-publish`` (their
  at-least-once dead-lettering needs it), so a full quorum queue never overflows.
- ``on_expire: drop`` on a quorum queue: it dead-letters at least once, so an expired message
  with no route is kept, out of sight, rather than dropped.
- ``park`` for one and ``drop`` for the other on a classic queue: both leave through the one
  dead-letter route.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.topology import naming
from rabbit_retry.topology.resolved import QueueConfig

Path = tuple[str | int, ...]
Found = tuple[Path, str]

# (policy field, policy key, queue argument) that set a length limit, and the one for a TTL.
LENGTH_LIMITS = (("max_length", "max-length", "x-max-length"),
                 ("max_length_bytes", "max-length-bytes", "x-max-length-bytes"))
# A TTL as an argument is refused on its own (check.MANAGED_QUEUE_ARGUMENTS).
TTL = ("message_ttl", "message-ttl", "")


def _where(queue: QueueConfig, keys: tuple[tuple[str, str, str], ...]) -> Path | None:
    """The key path of the first of ``keys`` the queue sets, in its policy or its arguments."""
    path: Path = ("queues", queue.name)
    for field, policy_key, argument in keys:
        if policy_key in queue.policy:
            return (*path, "policy", field)
        value = queue.arguments.get(argument)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # else: a
            # problem of its own
            return (*path, "arguments", argument)
    return None


def limit_problems(queue: QueueConfig) -> list[Found]:
    """Every problem with what ``queue``'s limit and TTL do to a message, as (path, message)."""
    path: Path = ("queues", queue.name)
    parking = naming.parking_queue(queue.name)
    quorum = queue.queue_type == "quorum"
    found: list[Found] = []
    length = _where(queue, LENGTH_LIMITS)
    if length is not None and queue.on_full is None:
        found.append((length, "a length limit needs on_full: reject beside it (when the queue is "
                              "full, new publishes are refused; publishers with confirms get a "
                              "nack)" if quorum else
                              "a length limit needs on_full beside it: park (when the queue is "
                              f"full, its oldest message moves to {parking}) or drop"))
    ttl = _where(queue, (TTL,))
    if ttl is not None and queue.on_expire is None:
        found.append((ttl, "a message TTL needs on_expire: park beside it (expired messages "
                           f"move to {parking})" if quorum else
                           "a message TTL needs on_expire beside it: park (expired messages "
                           f"move to {parking}) or drop"))
    if queue.on_full == "reject" and not quorum:
        found.append(((*path, "on_full"),
                      "a classic queue that refuses publishes also refuses the retried messages "
                      "coming back from its tiers while it is full, and drops them; use on_full: "
                      "park or drop, or queue_type: quorum"))
    elif queue.on_full in ("park", "drop") and quorum:
        found.append(((*path, "on_full"),
                      "a full quorum queue refuses new publishes (reject-publish, which its "
                      "at-least-once dead-lettering needs): nothing overflows to park or drop; "
                      "write on_full: reject"))
    if queue.on_expire == "drop" and quorum:
        found.append(((*path, "on_expire"),
                      "a quorum queue dead-letters at least once: an expired message with no "
                      "route is kept out of sight, not dropped; write on_expire: park "
                      f"({parking})"))
    if not quorum and {queue.on_full, queue.on_expire} == {"park", "drop"}:
        found.append(((*path, "on_expire"),
                      f"on_full: {queue.on_full} and on_expire: {queue.on_expire}: a classic "
                      "queue sends the overflowed and the expired the same way; give both the "
                      "same value"))
    found += _overflow_problems(queue)
    return found


def _overflow_problems(queue: QueueConfig) -> list[Found]:
    """``overflow`` / ``x-overflow`` beside ``on_full``: only the one that agrees with it."""
    if queue.on_full not in ("park", "drop") or queue.queue_type == "quorum":
        return []
    overflow: Any = queue.policy.get("overflow", queue.arguments.get("x-overflow"))
    # reject-publish is refused on a classic queue whatever else the file says (check.py).
    if overflow is None or overflow in ("drop-head", "reject-publish"):
        return []
    where: Path = (("queues", queue.name, "policy", "overflow") if "overflow" in queue.policy
                   else ("queues", queue.name, "arguments", "x-overflow"))
    return [(where, f"overflow {overflow} contradicts on_full: {queue.on_full}; leave it out "
                    "(on_full says what a full queue does)")]
