"""Every row of the decision table (README, "The worker": what happens to a delivery)."""

from __future__ import annotations

import pytest

from rabbit_retry.topology.resolved import RetryPolicy
from rabbit_retry.worker.consumer import HandlerTimeout, Permanent
from rabbit_retry.worker.decide import (
    ACK,
    Ack,
    NativeRetry,
    Outcome,
    Park,
    ParkReason,
    TierRetry,
    before_handler,
    classify,
    decide,
    uses_native_retry,
)

THREE = RetryPolicy(delays_ms=(5_000, 30_000, 300_000), max_attempts=5)
ONE = RetryPolicy(delays_ms=(10_000,), max_attempts=3)
SAME_TWICE = RetryPolicy(delays_ms=(1_000, 1_000), max_attempts=4)  # one distinct tier
NO_RETRY = RetryPolicy(delays_ms=(5_000,), max_attempts=1)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("policy", [THREE, ONE, NO_RETRY])
@pytest.mark.parametrize("failures", [0, 1, 4])
def test_success_acks(queue_type: str, policy: RetryPolicy, failures: int) -> None:
    assert decide(Outcome.SUCCESS, failures, policy, queue_type) == Ack()  # type: ignore[arg-type]
    assert decide(Outcome.SUCCESS, failures, policy, queue_type) is ACK  # type: ignore[arg-type]


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("failures", [0, 1, 3])
def test_permanent_parks_at_once_counting_this_failure(queue_type: str, failures: int) -> None:
    action = decide(Outcome.PERMANENT, failures, THREE, queue_type)  # type: ignore[arg-type]
    assert action == Park(ParkReason.PERMANENT, failures + 1)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("failures", [0, 2])
def test_invalid_parks_at_once_with_the_failures_it_arrived_with(
    queue_type: str, failures: int
) -> None:
    action = decide(Outcome.INVALID, failures, ONE, queue_type)  # type: ignore[arg-type]
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
    assert decide(Outcome.FAILED, failures, THREE, queue_type) == expected  # type: ignore[arg-type]


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
    assert decide(Outcome.FAILED, failures, ONE, "quorum") == expected


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
    assert decide(Outcome.FAILED, failures, ONE, "classic") == expected


def test_repeated_delay_is_one_tier_so_quorum_goes_native() -> None:
    assert uses_native_retry(SAME_TWICE, "quorum")
    assert not uses_native_retry(SAME_TWICE, "classic")
    assert not uses_native_retry(THREE, "quorum")
    assert decide(Outcome.FAILED, 1, SAME_TWICE, "quorum") == NativeRetry(2, 1_000)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_max_attempts_one_parks_the_first_failure(queue_type: str) -> None:
    action = decide(Outcome.FAILED, 0, NO_RETRY, queue_type)  # type: ignore[arg-type]
    assert action == Park(ParkReason.EXHAUSTED, 1)


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        (0, None),
        (4, None),
        (5, Park(ParkReason.EXHAUSTED, 5)),
        (9, Park(ParkReason.EXHAUSTED, 9)),  # e.g. max_attempts lowered while it waited
    ],
)
def test_before_handler_parks_a_message_with_no_attempt_left(
    failures: int, expected: object
) -> None:
    assert before_handler(failures, THREE) == expected


def test_a_failure_arriving_beyond_max_attempts_still_parks_exhausted() -> None:
    # decide() is only reached with attempts left, but stays total for any input.
    assert decide(Outcome.FAILED, 7, THREE, "quorum") == Park(ParkReason.EXHAUSTED, 8)


def test_tier_labels_name_the_tier_queues() -> None:
    from rabbit_retry.topology import naming

    for failures in range(4):
        action = decide(Outcome.FAILED, failures, THREE, "classic")
        assert isinstance(action, TierRetry)
        assert naming.tier_queue("q", action.delay_ms) == f"q.retry.{action.tier}"


def test_a_message_the_broker_cannot_dead_letter_takes_the_publish_path() -> None:
    action = decide(Outcome.FAILED, 0, ONE, "quorum", native_ok=False)
    assert action == TierRetry(1, 10_000, "10s")
    # Only the retry path changes: parking and acking are the same either way.
    assert decide(Outcome.FAILED, 2, ONE, "quorum", native_ok=False) == Park(
        ParkReason.EXHAUSTED, 3
    )
    assert decide(Outcome.SUCCESS, 0, ONE, "quorum", native_ok=False) is ACK


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
