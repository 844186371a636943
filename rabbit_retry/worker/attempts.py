"""How many times a delivery has already failed, and where it was first published (pure).

Every piece of knowledge about how RabbitMQ versions write dead-lettering headers lives in this
module; nothing else in the worker reads ``x-death`` or its siblings.

What the broker writes, by version (AMQP 0-9-1 view, as the ``dlx`` guide and the release notes
describe it):

- **3.10 / 3.12**: each dead-lettering adds or updates one ``x-death`` table per
  ``(queue, reason)`` pair: ``count`` (a long), ``reason``, ``queue``, ``time``, ``exchange``,
  ``routing-keys`` (and ``original-expiration`` when a per-message TTL was removed). A second
  death for the same pair increments ``count`` and moves the table to the front, keeping the
  ``exchange`` and ``routing-keys`` of the first death. The first death also sets
  ``x-first-death-reason``/``-queue``/``-exchange``. The broker honours an ``x-death`` header
  that a client republishes (and keeps counting on it).
- **3.13.0 - 3.13.2**: the same shape, but a client-republished ``x-death`` is no longer
  interpreted (counts restart); 3.13.3 restored the 3.12 behaviour. ``x-last-death-reason`` /
  ``-queue`` / ``-exchange`` appear from 3.13 on.
- **4.x**: ``x-death`` is rendered from broker-internal annotations, newest death first (by
  last time), one entry per ``(queue, reason)`` with ``count``, ``reason``, ``queue``, ``time``
  (of the first death), ``exchange`` and ``routing-keys`` of the first death. An ``x-death``
  header set by a client is ignored. Quorum queues also add ``x-delivery-count`` (and have a
  default delivery limit of 20, after which they dead-letter with reason ``delivery_limit``).

Why we can ignore the differences: the worker strips ``x-death`` from every copy it publishes
and carries its own count in ``retry-count`` (a plain header, which every version leaves
alone), so the only ``x-death`` counts we read are ones the broker made itself while the
message stayed inside the broker (the native ``nack`` path and quorum delivery limits), which
all versions count the same way. ``x-delivery-count`` is deliberately not a failure: it also
counts redeliveries after a worker crash or restart, which are not handler failures.

Quorum delivery limits and dead-letter cycles. A quorum queue with a delivery limit dead-letters
a message returned to it more often than the limit (worker crashes, lost connections,
shutdowns), with reason ``delivery_limit``, into the first tier. That tier cannot hand it back:
every version drops, or with at-least-once dead-lettering holds for ever, a message whose way
back to ``Q`` closes a dead-letter cycle in which no client rejected it (``delivery_limit`` then
``expired``: seen on 3.10, "Dead-letter queues cycle detected"). So the worker never lets the
broker get there: the delivery whose next return would cross the limit is not handed to the
handler but counted as one failed attempt and retried or parked by the worker itself. How each
version counts returns, and when the broker's own ``nack`` cycle may be used, is in
``redelivery``.

Failures so far = max(``retry-count``, sum of ``count`` over ``x-death`` entries for queue
``Q`` with reason ``rejected`` or ``delivery_limit``) (docs/versions.md, "How attempts are
counted"). Every value read here may be garbled by some client on the way; a garbled value
counts as 0 and nothing here raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rabbit_retry.contract import (
    MAX_COUNT,
    ORIGINAL_EXCHANGE,
    ORIGINAL_ROUTING_KEY,
    RETRY_COUNT,
    X_DEATH,
    X_FIRST_DEATH_EXCHANGE,
    X_FIRST_DEATH_QUEUE,
    as_count,
    as_text,
)

# Reasons that mean "the handler (or the consumer process) failed on this queue". ``expired``
# (a tier's TTL) and ``maxlen`` (overflow) are not failures.
FAILURE_REASONS = frozenset({"rejected", "delivery_limit"})


def _death_entries(headers: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    deaths = headers.get(X_DEATH)
    if not isinstance(deaths, list | tuple):
        return []
    return [entry for entry in deaths if isinstance(entry, Mapping)]


def failures_so_far(headers: object, queue: str) -> int:
    """Failed handler attempts on ``queue`` recorded in ``headers`` (README, "The worker")."""
    if not isinstance(headers, Mapping) or not headers:
        return 0
    try:
        counted = as_count(headers.get(RETRY_COUNT)) or 0
        died = 0
        for entry in _death_entries(headers):
            if as_text(entry.get("queue")) != queue:
                continue
            if as_text(entry.get("reason")) not in FAILURE_REASONS:
                continue
            died += as_count(entry.get("count")) or 0
        return min(max(counted, died), MAX_COUNT)
    except Exception:  # a hostile Mapping subclass: garbled, so 0; the worker must not crash
        return 0


def broker_can_dead_letter(headers: object) -> bool:
    """Whether the broker may dead-letter this message itself (the native ``nack`` path).

    RabbitMQ 3.x updates ``x-death`` in place when it dead-letters: it groups the entries as
    tables and adds 1 to ``count``. An entry that is not a table, or a ``count`` that is not an
    integer, crashes that step; on a quorum queue with at-least-once dead-lettering the message
    then sits in the queue's dead-letter process, retried and crashing, instead of reaching the
    tier. Only a client can have written such an ``x-death`` (the broker never does), so such a
    message takes the publish path instead, whose copy carries no ``x-death`` at all. 4.x
    ignores a client-set ``x-death``, so being strict here costs nothing there.
    """
    if not isinstance(headers, Mapping) or X_DEATH not in headers:
        return True
    try:
        deaths = headers[X_DEATH]
        if not isinstance(deaths, list):
            return False
        for entry in deaths:
            if not isinstance(entry, Mapping):
                return False
            count = entry.get("count", 0)
            if isinstance(count, bool) or not isinstance(count, int):
                return False
            if not 0 <= count <= MAX_COUNT:  # counting on from it, we would read 0 forever
                return False
            for key in ("queue", "reason", "exchange"):
                if key in entry and not isinstance(entry[key], str | bytes):
                    return False
            keys = entry.get("routing-keys", [])
            if not isinstance(keys, list) or not all(isinstance(k, str | bytes) for k in keys):
                return False
    except Exception:  # a hostile Mapping: not something to hand to the broker
        return False
    return True


def original_source(
    headers: object, queue: str, exchange: str, routing_key: str
) -> tuple[str, str]:
    """Where the message was first published: ``(exchange, routing_key)``.

    In order: the ``original-*`` headers the worker puts on its copies; the ``x-death`` entry
    for ``queue`` (every version keeps the first death's exchange and routing keys there), with
    ``x-first-death-exchange`` standing in for a missing exchange when that first death was on
    ``queue``; finally the delivery's own exchange and routing key (a first delivery).
    """
    if not isinstance(headers, Mapping) or not headers:
        return exchange, routing_key
    try:
        ex = as_text(headers.get(ORIGINAL_EXCHANGE))
        rk = as_text(headers.get(ORIGINAL_ROUTING_KEY))
        if ex is not None and rk is not None:
            return ex, rk
        for entry in reversed(_death_entries(headers)):  # oldest last in every version
            if as_text(entry.get("queue")) != queue:
                continue
            keys = entry.get("routing-keys")
            first_key = as_text(keys[0]) if isinstance(keys, list | tuple) and keys else None
            death_exchange = as_text(entry.get("exchange"))
            if death_exchange is None and as_text(headers.get(X_FIRST_DEATH_QUEUE)) == queue:
                death_exchange = as_text(headers.get(X_FIRST_DEATH_EXCHANGE))
            if death_exchange is not None and first_key is not None:
                return death_exchange, first_key
    except Exception:  # garbled headers never crash the worker
        pass
    return exchange, routing_key
