"""The decision table (README, "The worker"): what happens to a delivery after its handler ran.

Pure: which outcome an exception means (``classify``); then outcome, failures so far, the
queue's retry policy and type in, one action out (``decide``).

Why native retry only on quorum queues with a single tier: ``nack(requeue=False)`` lets the
broker dead-letter the message into the first tier, which only reaches the tier keyed by the
queue's own name, so it only works when there is one tier. And only quorum queues dead-letter
at-least-once (the compiler sets ``x-dead-letter-strategy: at-least-once``); a classic queue
dead-letters at-most-once and drops the message if the route is missing, so classic queues
always take the confirmed-publish path, even with one delay.

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
from rabbit_retry.worker.consumer import HandlerTimeout, Permanent


class Outcome(enum.Enum):
    SUCCESS = "success"
    PERMANENT = "permanent"  # Permanent raised, or a type listed in permanent_errors
    INVALID = "invalid"  # the body failed JSON decoding or the consumer's model
    FAILED = "failed"  # any other exception, or the handler timed out


class ParkReason(enum.StrEnum):
    EXHAUSTED = "exhausted"
    PERMANENT = "permanent"
    INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class Ack:
    """Done: acknowledge the delivery."""


@dataclass(frozen=True, slots=True)
class NativeRetry:
    """``nack(requeue=False)``: the broker dead-letters the message into the only tier."""

    retry_count: int
    delay_ms: int


@dataclass(frozen=True, slots=True)
class TierRetry:
    """Publish a copy to ``Q.retry`` with routing key ``tier`` (confirmed), then ack."""

    retry_count: int
    delay_ms: int
    tier: str


@dataclass(frozen=True, slots=True)
class Park:
    """Publish a copy to ``Q.parking`` (confirmed), then ack."""

    reason: ParkReason
    retry_count: int


Action = Ack | NativeRetry | TierRetry | Park

ACK = Ack()


def classify(
    error: BaseException,
    *,
    payload_invalid: bool,
    permanent_errors: tuple[type[BaseException], ...] = (),
) -> Outcome:
    """What a handler's exception means.

    A handler that read a ``payload`` that is not JSON fails ``INVALID`` whatever it raised
    after; a timeout is ``FAILED`` (transient) even if ``TimeoutError`` is listed as permanent;
    ``Permanent`` and the consumer's ``permanent_errors`` are ``PERMANENT``; anything else is
    ``FAILED``.
    """
    if payload_invalid:
        return Outcome.INVALID
    if isinstance(error, HandlerTimeout):
        return Outcome.FAILED
    if isinstance(error, (Permanent, *permanent_errors)):
        return Outcome.PERMANENT
    return Outcome.FAILED


def before_handler(failures: int, policy: RetryPolicy) -> Park | None:
    """Park without calling the handler when no attempt is left (e.g. max_attempts lowered)."""
    if failures >= policy.max_attempts:
        return Park(ParkReason.EXHAUSTED, failures)
    return None


def uses_native_retry(policy: RetryPolicy, queue_type: QueueType) -> bool:
    return queue_type == "quorum" and len(policy.tiers_ms) == 1


def decide(
    outcome: Outcome,
    failures: int,
    policy: RetryPolicy,
    queue_type: QueueType,
    *,
    native_ok: bool = True,
) -> Action:
    """The action for a delivery that arrived with ``failures`` failed attempts behind it.

    ``native_ok`` is False when the broker cannot safely dead-letter this message itself
    (``attempts.broker_can_dead_letter``): it then takes the publish path even where native
    retry would apply.
    """
    if outcome is Outcome.SUCCESS:
        return ACK
    if outcome is Outcome.INVALID:
        return Park(ParkReason.INVALID, failures)
    after = failures + 1
    if outcome is Outcome.PERMANENT:
        return Park(ParkReason.PERMANENT, after)
    if after >= policy.max_attempts:
        return Park(ParkReason.EXHAUSTED, after)
    delay_ms = policy.delay_for(after)
    if native_ok and uses_native_retry(policy, queue_type):
        return NativeRetry(after, delay_ms)
    return TierRetry(after, delay_ms, naming.tier_routing_key(delay_ms))
