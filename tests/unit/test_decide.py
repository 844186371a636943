"""Every row of the decision table (README, "The worker": what happens to a delivery): one
``decide`` from a delivery's history, what happened to it and its queue's rules."""

from __future__ import annotations

import pytest

from rabbit_retry.topology.resolved import QueueType, RetryPolicy
from rabbit_retry.worker.consumer import HandlerTimeout, Permanent
from rabbit_retry.worker.decide import (
    ACK,
    HANDLE,
    Ack,
    Cause,
    NativeRetry,
    Outcome,
    Park,
    ParkReason,
    Requeue,
    Rules,
    TierRetry,
    classify,
    decide,
    runs_alone,
    uses_native_retry,
)
from rabbit_retry.worker.history import FIRST, History
from rabbit_retry.worker.redelivery import counting


def rules(policy: RetryPolicy, queue_type: str, *, limit: int | None = 20,
          version: str = "3.10.8") -> Rules:
    qtype: QueueType = queue_type  # type: ignore[assignment]
    return Rules(policy, qtype, limit if queue_type == "quorum" else None, counting(version))


def old_decide(outcome: Outcome, failures: int, policy: RetryPolicy, queue_type: str, *,
               native_ok: bool = True) -> object:
    """A delivery that failed ``failures`` times by the broker's count (so the broker's own
    ``nack`` cycle stays usable unless ``native_ok`` is False: a client's ``x-death``)."""
    history = History(failures=failures, broker_failures=failures, x_death_clean=native_ok)
    return decide(history, outcome, rules(policy, queue_type))

THREE = RetryPolicy(delays_ms=(5_000, 30_000, 300_000), max_attempts=5)
ONE = RetryPolicy(delays_ms=(10_000,), max_attempts=3)
SAME_TWICE = RetryPolicy(delays_ms=(1_000, 1_000), max_attempts=4)  # one distinct tier
NO_RETRY = RetryPolicy(delays_ms=(5_000,), max_attempts=1)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("policy", [THREE, ONE, NO_RETRY])
@pytest.mark.parametrize("failures", [0, 1, 4])
def test_success_acks(queue_type: str, policy: RetryPolicy, failures: int) -> None:
    assert old_decide(Outcome.SUCCESS, failures, policy, queue_type) == Ack()  # type: ignore[arg-type]
    assert old_decide(Outcome.SUCCESS, failures, policy, queue_type) is ACK  # type: ignore[arg-type]


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("failures", [0, 1, 3])
def test_permanent_parks_at_once_counting_this_failure(queue_type: str, failures: int) -> None:
    action = old_decide(Outcome.PERMANENT, failures, THREE, queue_type)  # type: ignore[arg-type]
    assert action == Park(ParkReason.PERMANENT, failures + 1)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("failures", [0, 2])
def test_invalid_parks_at_once_with_the_failures_it_arrived_with(
    queue_type: str, failures: int
) -> None:
    action = old_decide(Outcome.INVALID, failures, ONE, queue_type)  # type: ignore[arg-type]
    assert action == Park(ParkReason.INVALID, failures)


# Several delays: tier = delays[min(failures, len(delays)) - 1], failures counted after this one.
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        (0, TierRetry(1, 5_000, "5s")),
        (1, TierRetry(2, 30_000, "30s")),
        (2, TierRetry(3, 300_000, "5m")),
        (3, TierRetry(4, 300_000, "5m")),  # past the last delay: the last tier again
        (4, Park(ParkReason.EXHAUSTED, 5)),  # the 5th call failed: retry-count == max_attempts
    ],
)
def test_transient_failure_with_several_delays(
    queue_type: str, failures: int, expected: object
) -> None:
    assert old_decide(Outcome.FAILED, failures, THREE, queue_type) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        (0, NativeRetry(1, 10_000)),
        (1, NativeRetry(2, 10_000)),
        (2, Park(ParkReason.EXHAUSTED, 3)),
    ],
)
def test_transient_failure_with_one_delay_on_quorum_is_native(
    failures: int, expected: object
) -> None:
    assert old_decide(Outcome.FAILED, failures, ONE, "quorum") == expected


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        (0, TierRetry(1, 10_000, "10s")),
        (1, TierRetry(2, 10_000, "10s")),
        (2, Park(ParkReason.EXHAUSTED, 3)),
    ],
)
def test_transient_failure_with_one_delay_on_classic_publishes(
    failures: int, expected: object
) -> None:
    # Classic dead-lettering is at-most-once: a classic queue always takes the confirmed path.
    assert old_decide(Outcome.FAILED, failures, ONE, "classic") == expected


def test_repeated_delay_is_one_tier_so_quorum_goes_native() -> None:
    assert uses_native_retry(SAME_TWICE, "quorum")
    assert not uses_native_retry(SAME_TWICE, "classic")
    assert not uses_native_retry(THREE, "quorum")
    assert old_decide(Outcome.FAILED, 1, SAME_TWICE, "quorum") == NativeRetry(2, 1_000)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_max_attempts_one_parks_the_first_failure(queue_type: str) -> None:
    action = old_decide(Outcome.FAILED, 0, NO_RETRY, queue_type)  # type: ignore[arg-type]
    assert action == Park(ParkReason.EXHAUSTED, 1)


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        (0, HANDLE),
        (4, HANDLE),
        (5, Park(ParkReason.EXHAUSTED, 5, Cause.ON_ARRIVAL)),
        (9, Park(ParkReason.EXHAUSTED, 9, Cause.ON_ARRIVAL)),  # max_attempts lowered meanwhile
    ],
)
def test_on_arrival_a_message_with_no_attempt_left_parks_unhandled(
    failures: int, expected: object
) -> None:
    assert old_decide(Outcome.ARRIVED, failures, THREE, "quorum") == expected


def test_a_failure_arriving_beyond_max_attempts_still_parks_exhausted() -> None:
    # A handler outcome only follows an arrival with attempts left, but decide stays total.
    assert old_decide(Outcome.FAILED, 7, THREE, "quorum") == Park(ParkReason.EXHAUSTED, 8)


def test_tier_labels_name_the_tier_queues() -> None:
    from rabbit_retry.topology import naming

    for failures in range(4):
        action = old_decide(Outcome.FAILED, failures, THREE, "classic")
        assert isinstance(action, TierRetry)
        assert naming.tier_queue("q", action.delay_ms) == f"q.retry.{action.tier}"


def test_a_message_the_broker_cannot_dead_letter_takes_the_publish_path() -> None:
    action = old_decide(Outcome.FAILED, 0, ONE, "quorum", native_ok=False)
    assert action == TierRetry(1, 10_000, "10s")
    # Only the retry path changes: parking and acking are the same either way.
    assert old_decide(Outcome.FAILED, 2, ONE, "quorum", native_ok=False) == Park(
        ParkReason.EXHAUSTED, 3
    )
    assert old_decide(Outcome.SUCCESS, 0, ONE, "quorum", native_ok=False) is ACK


# --- which outcome an exception means -----------------------------------------------------------


class Declined(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "payload_invalid", "permanent_errors", "outcome"),
    [
        (RuntimeError("x"), False, (), Outcome.FAILED),
        (Permanent("no"), False, (), Outcome.PERMANENT),
        (Declined(), False, (Declined,), Outcome.PERMANENT),
        (Declined(), False, (), Outcome.FAILED),
        (HandlerTimeout("slow"), False, (TimeoutError,), Outcome.FAILED),  # a timeout retries
        (TimeoutError(), False, (TimeoutError,), Outcome.PERMANENT),  # the handler's own
        (Permanent("no"), True, (), Outcome.INVALID),  # read a payload that is not JSON
        (RuntimeError("x"), True, (), Outcome.INVALID),
    ],
)
def test_classify(
    error: BaseException,
    payload_invalid: bool,
    permanent_errors: tuple[type[BaseException], ...],
    outcome: Outcome,
) -> None:
    assert classify(error, payload_invalid=payload_invalid,
                    permanent_errors=permanent_errors) is outcome


# --- arrivals: returns, crash loops, a paused queue ---------------------------------------------


def test_a_first_delivery_runs() -> None:
    for queue_type in ("quorum", "classic"):
        assert decide(FIRST, Outcome.ARRIVED, rules(THREE, queue_type)) is HANDLE


@pytest.mark.parametrize(("returns", "expected"), [(19, HANDLE), (20, "limit"), (25, "limit")])
def test_a_quorum_delivery_at_its_limit_counts_as_a_failed_attempt_unhandled(
    returns: int, expected: object
) -> None:
    history = History(failures=1, retry_count=1, returns=returns, redelivered=True)
    action = decide(history, Outcome.ARRIVED, rules(THREE, "quorum", version="4.3.6"))
    if expected is HANDLE:
        assert action is HANDLE
    else:
        assert action == TierRetry(2, 30_000, "30s", Cause.DELIVERY_LIMIT)


def test_a_quorum_delivery_at_its_last_attempt_and_limit_parks_exhausted() -> None:
    history = History(failures=2, retry_count=2, returns=3, redelivered=True)
    action = decide(history, Outcome.ARRIVED, rules(ONE, "quorum", limit=3))
    assert action == Park(ParkReason.EXHAUSTED, 3, Cause.DELIVERY_LIMIT)


def test_without_a_limit_returns_are_never_counted_on_quorum() -> None:
    history = History(returns=500, redelivered=True)
    assert decide(history, Outcome.ARRIVED, rules(THREE, "quorum", limit=None)) is HANDLE


def test_a_classic_queue_counts_returns_on_a_copy_then_runs_it() -> None:
    """Classic queues count no returns: the worker sends a returned delivery back as a copy
    carrying the count, which then runs alone; at the limit, one failed attempt."""
    classic = rules(THREE, "classic")
    returned = History(failures=1, retry_count=1, returns=4, redelivered=True)
    assert decide(returned, Outcome.ARRIVED, classic) == Requeue(1, 5)
    copy = History(failures=1, retry_count=1, returns=5)  # the copy: not redelivered
    assert decide(copy, Outcome.ARRIVED, classic) is HANDLE
    assert runs_alone(copy, "classic") and runs_alone(returned, "classic")
    at_limit = History(failures=1, retry_count=1, returns=19, redelivered=True)
    assert decide(at_limit, Outcome.ARRIVED, classic) == TierRetry(2, 30_000, "30s",
                                                                    Cause.DELIVERY_LIMIT)


def test_who_runs_alone() -> None:
    assert not runs_alone(FIRST, "quorum") and not runs_alone(FIRST, "classic")
    counted = History(returns=1, redelivered=True)
    assert runs_alone(counted, "quorum")
    # 4.3 marks a clean nack(requeue) redelivered without counting it.
    assert not runs_alone(History(redelivered=True), "quorum")
    assert runs_alone(History(redelivered=True), "classic")


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_a_delivery_held_by_a_pause_goes_back_unchanged(queue_type: str) -> None:
    history = History(failures=2, retry_count=2)
    assert decide(history, Outcome.HELD, rules(THREE, queue_type)) == Requeue(2, 0)


def test_a_duplicate_is_acked() -> None:
    assert decide(FIRST, Outcome.DUPLICATE, rules(THREE, "quorum")) is ACK


@pytest.mark.parametrize(
    ("history", "version", "native"),
    [
        (FIRST, "3.10.8", True),
        (History(returns=3, redelivered=True), "3.10.8", True),  # 3.x resets it in the cycle
        (FIRST, "4.0.5", False),  # 4.0-4.2: the cycle itself counts
        (FIRST, "4.3.6", True),
        (History(returns=1, redelivered=True), "4.3.6", False),  # 4.3 carries the 1 along
        (History(failures=1, retry_count=1), "3.10.8", False),  # a copy stays a copy
        (History(x_death_clean=False), "3.10.8", False),  # 3.x could not update it
    ],
)
def test_when_the_broker_retries_a_one_tier_quorum_failure_itself(
    history: History, version: str, native: bool
) -> None:
    action = decide(history, Outcome.FAILED, rules(ONE, "quorum", version=version))
    assert isinstance(action, NativeRetry if native else TierRetry)
