"""The decision table (README, "The worker"): what happens to a delivery (pure).

One function, ``decide``, takes a delivery's ``History`` (read once from its headers), what has
happened to it so far (``Outcome``: it just arrived, or its handler returned, raised, was
skipped) and its queue's ``Rules``, and returns one ``Action``: run the handler, ack, let the
broker retry it (``nack``), publish a tier copy, park it, or send it back to the end of its
queue. The session carries the action out and never decides anything itself.

Why the broker's own ``nack`` cycle only on quorum queues with a single tier: ``nack(requeue=
False)`` lets the broker dead-letter the message into the first tier, which only reaches the
tier keyed by the queue's own name, so it only works with one tier. And only quorum queues
dead-letter at-least-once; a classic queue dead-letters at-most-once and drops the message if
the route is missing, so classic queues always take the confirmed-copy path. Where the broker's
cycle would not leave the message as a fresh copy would, a copy is published instead
(``redelivery``): always usable on 3.x, never on 4.0-4.2, from a count of zero on 4.3+.

A crash loop ends on every queue type. A delivery that came back without a verdict (its worker
died, lost its connection or stopped past its grace) runs alone (``Lane``), and its returns are
counted: by the broker on quorum queues (``x-delivery-count``), by rabbit-retry on classic
queues, which count nothing (a returned delivery is sent back as a confirmed copy carrying
``return-count``, then runs alone). At the limit the delivery is not handed to the handler: the
returns count as one failed attempt (``Cause.DELIVERY_LIMIT``), retried or parked as any other.

``retry-count`` always means "failed handler calls so far": a copy written after this failure
carries ``failures + 1``; a message parked ``exhausted`` after ``max_attempts`` calls carries
exactly ``max_attempts``; a message parked before its handler ran (``invalid``, or arriving
already exhausted) carries the failures it arrived with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rabbit_retry.topology import naming
from rabbit_retry.topology.resolved import QueueType, RetryPolicy
from rabbit_retry.worker.batch import BatchError
from rabbit_retry.worker.consumer import HandlerTimeout, Permanent
from rabbit_retry.worker.history import History
from rabbit_retry.worker.redelivery import WORKER_RETURN_LIMIT, Counting


class Outcome(enum.Enum):
    ARRIVED = "arrived"  # not run yet: may its handler run?
    SUCCESS = "success"
    DUPLICATE = "duplicate"  # its idempotency key was done already: not run
    PERMANENT = "permanent"  # Permanent raised, or a type listed in permanent_errors
    INVALID = "invalid"  # the body failed JSON decoding or the consumer's model
    FAILED = "failed"  # any other exception, or the handler timed out
    HELD = "held"  # not charged: its queue is paused (not started, or a watched failure then)


class ParkReason(enum.StrEnum):
    EXHAUSTED = "exhausted"
    PERMANENT = "permanent"
    INVALID = "invalid"


class Cause(enum.Enum):
    """What the attempt an action charges (or parks for) consisted of."""

    HANDLER = "handler"  # the handler ran (or the body was refused before it)
    DELIVERY_LIMIT = "delivery_limit"  # came back too often without a verdict: not run
    ON_ARRIVAL = "on_arrival"  # arrived with no attempt left (max_attempts lowered, or
    # attempts charged elsewhere): not run


@dataclass(frozen=True, slots=True)
class Handle:
    """Run the handler, then decide again with its outcome."""


@dataclass(frozen=True, slots=True)
class Ack:
    """Done: acknowledge the delivery."""


@dataclass(frozen=True, slots=True)
class NativeRetry:
    """``nack(requeue=False)``: the broker dead-letters the message into the only tier."""

    retry_count: int
    delay_ms: int
    cause: Cause = Cause.HANDLER


@dataclass(frozen=True, slots=True)
class TierRetry:
    """Publish a copy to ``Q.retry`` with routing key ``tier`` (confirmed), then ack."""

    retry_count: int
    delay_ms: int
    tier: str
    cause: Cause = Cause.HANDLER


@dataclass(frozen=True, slots=True)
class Park:
    """Publish a copy to ``Q.parking`` (confirmed), then ack."""

    reason: ParkReason
    retry_count: int
    cause: Cause = Cause.HANDLER


@dataclass(frozen=True, slots=True)
class Requeue:
    """Publish a copy to the end of ``Q`` (confirmed), then ack: ``retry_count`` unchanged, and
    ``returns`` counted on it where the queue counts none (classic)."""

    retry_count: int
    returns: int


Action = Handle | Ack | NativeRetry | TierRetry | Park | Requeue
Retry = NativeRetry | TierRetry

HANDLE = Handle()
ACK = Ack()


@dataclass(frozen=True, slots=True)
class Rules:
    """What ``decide`` needs to know of a queue: its retry policy and type, how many returns a
    delivery may come back from (``redelivery.delivery_limit``: None where nothing counts them
    or the user turned the limit off), and how the connected broker version counts."""

    policy: RetryPolicy
    queue_type: QueueType
    delivery_limit: int | None
    counting: Counting
    # False for an ordered queue's lanes: a retry always leaves as a copy, which carries the
    # hold of its key (``ordering``); the broker's own cycle could carry nothing. False too
    # where the file routes the queue's dead letters to its parking queue or nowhere
    # (``on_full`` / ``on_expire``): a ``nack`` would end there, not in the tier.
    native: bool = True

    @property
    def counts_returns_itself(self) -> bool:
        """A classic queue counts no returns: rabbit-retry carries the count on the message."""
        return self.queue_type != "quorum"

    @property
    def return_limit(self) -> int | None:
        if self.counts_returns_itself:
            return WORKER_RETURN_LIMIT
        return self.delivery_limit


def classify(
    error: BaseException,
    *,
    payload_invalid: bool,
    permanent_errors: tuple[type[BaseException], ...] = (),
) -> Outcome:
    """What a handler's exception means.

    A handler that read a ``payload`` that is not JSON fails ``INVALID`` whatever it raised
    after; a timeout is ``FAILED`` (transient) even if ``TimeoutError`` is listed as permanent,
    and so is a batch result the worker could not split (``BatchError``);
    ``Permanent`` and the consumer's ``permanent_errors`` are ``PERMANENT``; anything else is
    ``FAILED``.
    """
    if payload_invalid:
        return Outcome.INVALID
    if isinstance(error, HandlerTimeout | BatchError):
        return Outcome.FAILED
    if isinstance(error, (Permanent, *permanent_errors)):
        return Outcome.PERMANENT
    return Outcome.FAILED


def runs_alone(history: History, queue_type: QueueType) -> bool:
    """Whether the delivery came back without a verdict, so that it may be what took a worker
    down: it then never runs beside another (``Lane``), and a crash is charged to it alone.

    On a quorum queue the broker's count decides (4.3 marks a clean ``nack(requeue)``
    redelivered but does not count it); a classic queue has the flag, and the count rabbit-retry
    carried on the copy of a returned delivery.
    """
    if queue_type == "quorum":
        return history.returned
    return history.redelivered or history.returns > 0


def uses_native_retry(policy: RetryPolicy, queue_type: QueueType) -> bool:
    return queue_type == "quorum" and len(policy.tiers_ms) == 1


def native_ok(history: History, counting: Counting) -> bool:
    """Whether the broker's own ``nack`` cycle leaves this message as a fresh copy would
    (``redelivery``): 3.x always, 4.0-4.2 never, 4.3+ from a count of zero; never once a
    ``retry-count`` is set (the broker's count would restart below it, repeating attempts), nor
    for an ``x-death`` the broker could not count on from in place."""
    if counting.native_cycle == "adds":
        return False
    if counting.native_cycle == "keeps" and history.returns > 0:
        return False
    return history.retry_count == 0 and history.x_death_clean


def decide(history: History, outcome: Outcome, rules: Rules) -> Action:
    """The one action for a delivery with ``history`` after ``outcome``."""
    if outcome is Outcome.SUCCESS or outcome is Outcome.DUPLICATE:
        return ACK
    failures = history.failures
    if outcome is Outcome.ARRIVED:
        if failures >= rules.policy.max_attempts:
            return Park(ParkReason.EXHAUSTED, failures, Cause.ON_ARRIVAL)
        limit = rules.return_limit
        if rules.counts_returns_itself:
            if history.redelivered:  # one more return, counted on a copy
                returns = history.returns + 1
                if limit is None or returns < limit:
                    return Requeue(failures, returns)
                return _failed(history, rules, Cause.DELIVERY_LIMIT)
        elif limit is not None and history.redelivered and history.returns >= limit:
            # One more return and the broker would dead-letter it into a cycle it refuses
            # (redelivery): counted as one failed attempt, routed by the worker.
            return _failed(history, rules, Cause.DELIVERY_LIMIT)
        return HANDLE
    if outcome is Outcome.HELD:  # back unchanged, but a return not counted yet is counted
        returns = history.returns + history.redelivered if rules.counts_returns_itself else 0
        return Requeue(failures, returns)
    if outcome is Outcome.INVALID:
        return Park(ParkReason.INVALID, failures)
    if outcome is Outcome.PERMANENT:
        return Park(ParkReason.PERMANENT, failures + 1)
    return _failed(history, rules, Cause.HANDLER)


def _failed(history: History, rules: Rules, cause: Cause) -> Action:
    after = history.failures + 1
    policy = rules.policy
    if after >= policy.max_attempts:
        return Park(ParkReason.EXHAUSTED, after, cause)
    delay_ms = policy.delay_for(after)
    if (rules.native and uses_native_retry(policy, rules.queue_type)
            and native_ok(history, rules.counting)):
        return NativeRetry(after, delay_ms, cause)
    return TierRetry(after, delay_ms, naming.tier_routing_key(delay_ms), cause)
