"""A delivery's history, read from its properties once (pure): failures so far, returns, where it
was first published, its per-message TTL, and which of its headers may be believed.

Every piece of knowledge about what each RabbitMQ version writes into a message's headers when
it dead-letters it lives here and in ``redelivery`` (how each version counts returns);
docs/versions.md says how each fact was verified.

What the broker writes, by version (AMQP 0-9-1 view, as the ``dlx`` guide and release notes say):

- **3.10 / 3.12**: each dead-lettering adds or updates one ``x-death`` table per
  ``(queue, reason)``: ``count``, ``reason``, ``queue``, ``time``, ``exchange``,
  ``routing-keys`` (and ``original-expiration`` when a per-message TTL was removed). A second
  death for the same pair increments ``count`` and keeps the first death's ``exchange`` and
  ``routing-keys``. ``x-first-death-*`` name the first death. The broker honours (and counts on
  from) an ``x-death`` a client publishes.
- **3.13**: ``x-last-death-*`` appear; 3.13.0-3.13.2 ignore a client's ``x-death``.
- **4.x**: ``x-death`` is rendered from broker-internal annotations, one entry per
  ``(queue, reason)``, newest first. A client's ``x-death`` is ignored when the broker
  dead-letters, but delivered as it is to a consumer of a message the broker never
  dead-lettered. Quorum queues add ``x-delivery-count`` (4.3: ``x-acquired-count`` too).

Failures so far = max(``retry-count``, the sum of ``count`` over ``x-death`` entries for this
queue with reason ``rejected`` or ``delivery_limit``). ``x-delivery-count`` is not a failure: it
also counts returns after a crash or a restart (``redelivery``). Every value may be garbled by
some client on the way; a garbled value counts as 0, and nothing here raises.

**What a publisher can and cannot influence (the trust boundary).** Every copy rabbit-retry
makes comes back to its queue ``Q`` through the default exchange with routing key ``Q``: a tier
dead-letters it there, a replay and a paused queue's copy publish it there. So the headers that
carry rabbit-retry's own bookkeeping (``retry-count``, ``original-exchange``,
``original-routing-key``) and the broker's dead-lettering record (``x-death`` and its siblings)
are believed only on a delivery that arrived by that route; on a message published through any
exchange they are a publisher's words (or another system's history it carried along) and count
for nothing: no attempt taken away, no source rewritten, no broker ``nack`` cycle that a 3.x
broker would count on from them. A client that publishes straight into ``Q`` through the default
exchange arrives by the same route as our copies, and can set them: give publishers a user
without write access to the default exchange's queues where that matters (README).
``handle-again`` is believed only from a replayer's user (``dedupe``), whose ``user_id`` the broker
checks against the publishing connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry.contract import (
    MAX_COUNT,
    ORIGINAL_EXCHANGE,
    ORIGINAL_EXPIRATION,
    ORIGINAL_ROUTING_KEY,
    RETRY_COUNT,
    RETURN_COUNT,
    X_ACQUIRED_COUNT,
    X_DEATH,
    X_DELIVERY_COUNT,
    X_FIRST_DEATH_EXCHANGE,
    X_FIRST_DEATH_QUEUE,
    as_count,
    as_text,
)

# Reasons that mean "a consumer of this queue failed it". ``expired`` (a tier's TTL) and
# ``maxlen`` (overflow) are not failures.
FAILURE_REASONS = frozenset({"rejected", "delivery_limit"})


@dataclass(frozen=True, slots=True)
class History:
    """What the worker knows of a delivery before it runs (see the module docstring)."""

    failures: int = 0  # failed handler calls so far: max(retry_count, broker_failures)
    retry_count: int = 0  # the failures rabbit-retry recorded (``retry-count``)
    broker_failures: int = 0  # the rejections and delivery limits the broker recorded on Q
    # Came back without a verdict: as a quorum queue counts it (on a redelivery), or as the worker
    # counted it on the copy of a classic queue's returned delivery (``return-count``).
    returns: int = 0
    acquired: int = 0  # ``x-acquired-count`` (4.3+), redeliveries only
    redelivered: bool = False
    # Where it was first published, when that is not this delivery's own exchange/routing key.
    source: tuple[str, str] | None = None
    # A per-message TTL the broker moved into ``x-death`` when it dead-lettered the message (the
    # one-tier ``nack`` path), unless a copy of ours already keeps one in ``original-expiration``.
    moved_expiration: str | None = None
    # False when the message carries an ``x-death`` the broker could not count on from in
    # place: a client's, or a garbled one (a 3.x quorum queue's dead-letter worker crashes on
    # it). Such a message never takes the broker's own ``nack`` cycle.
    x_death_clean: bool = True

    @property
    def returned(self) -> bool:
        """Came back to the queue without a verdict, by the broker's count (quorum queues)."""
        return self.redelivered and self.returns > 0


FIRST = History()  # a first delivery without headers: most of the traffic
REDELIVERED = History(redelivered=True)


def read(
    headers: Mapping[str, Any] | None,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    queue: str,
    ours: bool | None = None,
) -> History:
    """The history of a delivery from ``queue`` that came through ``exchange`` with
    ``routing_key`` (the ``basic.deliver``'s) with these ``headers``. ``ours`` says whether
    that route is one only rabbit-retry's copies take (default: the default exchange with
    routing key ``queue``; an ordered queue's lanes also believe their lanes exchange and held
    queue)."""
    if not headers:
        return REDELIVERED if redelivered else FIRST
    if ours is None:
        ours = by_our_route(exchange, routing_key, queue)
    try:
        return _read(headers, redelivered, ours, queue)
    except Exception:  # a hostile Mapping: garbled, so nothing is believed; never a crash
        return History(redelivered=redelivered, x_death_clean=False)


def by_our_route(exchange: str, routing_key: str, queue: str) -> bool:
    """Whether a delivery from ``queue`` came the way every copy of rabbit-retry comes back (the
    default exchange, routing key ``queue``): only there are its bookkeeping headers believed
    (the module docstring)."""
    return exchange == "" and routing_key == queue


def _read(headers: Mapping[str, Any], redelivered: bool, our_route: bool, queue: str) -> History:
    returns = acquired = 0
    if redelivered:  # on a first delivery a count can only be a publisher's forgery
        returns = as_count(headers.get(X_DELIVERY_COUNT)) or 0
        acquired = as_count(headers.get(X_ACQUIRED_COUNT)) or 0
    deaths = headers.get(X_DEATH)
    if not our_route:
        return History(0, 0, 0, returns, acquired, redelivered, None, None, deaths is None)
    retry_count = as_count(headers.get(RETRY_COUNT)) or 0
    # A classic queue's returns, carried on the copy that sent the delivery back (``decide``).
    returns = max(returns, as_count(headers.get(RETURN_COUNT)) or 0)
    broker_failures = 0
    moved_expiration: str | None = None
    entries = _entries(deaths)
    for entry in entries:
        if as_text(entry.get("queue")) != queue:
            continue
        if moved_expiration is None and ORIGINAL_EXPIRATION not in headers:
            moved_expiration = as_text(entry.get("original-expiration"))
        if as_text(entry.get("reason")) in FAILURE_REASONS:
            broker_failures += as_count(entry.get("count")) or 0
    retry_count = min(retry_count, MAX_COUNT)
    broker_failures = min(broker_failures, MAX_COUNT)
    return History(
        max(retry_count, broker_failures),
        retry_count,
        broker_failures,
        returns,
        acquired,
        redelivered,
        _source(headers, entries, queue),
        moved_expiration,
        deaths is None or _clean(deaths),
    )


def _entries(deaths: object) -> list[Mapping[str, Any]]:
    if not isinstance(deaths, list | tuple):
        return []
    return [entry for entry in deaths if isinstance(entry, Mapping)]


def _source(
    headers: Mapping[str, Any], entries: list[Mapping[str, Any]], queue: str
) -> tuple[str, str] | None:
    """Where the message was first published: the ``original-*`` headers rabbit-retry puts on
    its copies; else the ``x-death`` entry for ``queue`` (every version keeps the first death's
    exchange and routing keys there), with ``x-first-death-exchange`` standing in for a missing
    exchange when that first death was on ``queue``; else None (this delivery's own)."""
    exchange = as_text(headers.get(ORIGINAL_EXCHANGE))
    routing_key = as_text(headers.get(ORIGINAL_ROUTING_KEY))
    if exchange is not None and routing_key is not None:
        return exchange, routing_key
    for entry in reversed(entries):  # oldest last in every version
        if as_text(entry.get("queue")) != queue:
            continue
        keys = entry.get("routing-keys")
        first_key = as_text(keys[0]) if isinstance(keys, list | tuple) and keys else None
        death_exchange = as_text(entry.get("exchange"))
        if death_exchange is None and as_text(headers.get(X_FIRST_DEATH_QUEUE)) == queue:
            death_exchange = as_text(headers.get(X_FIRST_DEATH_EXCHANGE))
        if death_exchange is not None and first_key is not None:
            return death_exchange, first_key
    return None


def _clean(deaths: object) -> bool:
    """Whether the broker could count on from this ``x-death`` in place.

    RabbitMQ 3.x updates ``x-death`` in place when it dead-letters: it groups the entries as
    tables and adds 1 to ``count``. An entry that is not a table, or a ``count`` that is not an
    integer, crashes that step; on a quorum queue with at-least-once dead-lettering the message
    then sits in the queue's dead-letter process, retried and crashing, instead of reaching the
    tier. The broker never writes such an ``x-death``, so such a message takes the copy path,
    whose copy carries no ``x-death`` at all.
    """
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
    return True
