"""A Pause's rules (pure): when it trips, what counts, what resumes it, what it refuses."""

from __future__ import annotations

import pytest

from rabbit_retry.errors import InputError
from rabbit_retry.worker import Pause, RetryConsumer
from rabbit_retry.worker.consumer import check_consumer
from rabbit_retry.worker.pause import Breaker, Change


class Down(ConnectionError):
    pass


def test_trips_after_n_distinct_messages_in_a_row() -> None:
    breaker = Breaker(Pause(after=3))
    assert breaker.failed("a") is Change.NONE
    assert breaker.failed("b") is Change.NONE
    assert not breaker.paused
    assert breaker.failed("c") is Change.PAUSED
    assert breaker.paused


def test_one_message_failing_again_and_again_is_not_an_outage() -> None:
    breaker = Breaker(Pause(after=2))
    for _ in range(10):
        assert breaker.failed("poison") is Change.NONE
    assert not breaker.paused
    assert breaker.failed("other") is Change.PAUSED


def test_a_success_resets_the_count_and_resumes() -> None:
    breaker = Breaker(Pause(after=2))
    breaker.failed("a")
    assert breaker.succeeded() is Change.NONE
    assert breaker.failed("b") is Change.NONE  # the count started over
    assert breaker.failed("c") is Change.PAUSED
    assert breaker.failed("d") is Change.NONE  # already paused: nothing more to say
    assert breaker.succeeded() is Change.RESUMED
    assert not breaker.paused
    assert breaker.streak == 0


def test_watches_the_listed_types_or_every_transient_failure() -> None:
    assert Pause(after=1).watches(RuntimeError())
    narrow = Pause(after=1, on=(Down,))
    assert narrow.watches(Down())
    assert not narrow.watches(RuntimeError())


@pytest.mark.parametrize(
    ("pause", "message"),
    [
        (Pause(after=0), "Charge.pause.after: expected an integer >= 1, got 0"),
        (Pause(after=True), "Charge.pause.after: expected an integer >= 1, got True"),
        (Pause(after=2, on=(Down, "x")),  # type: ignore[arg-type]
         "Charge.pause.on: expected a tuple of exception classes"),
        (Pause(after=2, probe_every=0), "Charge.pause.probe_every: expected a positive number"),
        (Pause(after=2, probe_every=float("inf")), "Charge.pause.probe_every: expected"),
        ("5", "Charge.pause: expected Pause(...) or None, got '5'"),
    ],
)
def test_a_bad_pause_is_refused_in_one_line(pause: object, message: str) -> None:
    class Charge(RetryConsumer):
        queue = "payments.charge"

        async def handle(self, delivery: object) -> None: ...

    consumer = Charge()
    consumer.pause = pause  # type: ignore[assignment]
    with pytest.raises(InputError) as caught:
        check_consumer(consumer)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)
