"""The one backoff rule: doubling from ``initial``, capped at ``maximum``, jittered downwards."""

from __future__ import annotations

from rabbit_retry.backoff import Backoff


def test_delays_double_within_their_jitter_and_never_pass_the_cap() -> None:
    backoff = Backoff(initial=0.5, maximum=30.0)
    for n in range(1, 40):
        ceiling = min(30.0, 0.5 * 2 ** (n - 1))
        delay = backoff.failed()
        assert ceiling / 2 <= delay <= ceiling, (n, delay)
    assert backoff.failures == 39


def test_a_success_ends_the_streak_and_says_how_long_it_was() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0)
    for _ in range(5):
        backoff.failed()
    assert backoff.succeeded() == 5
    assert backoff.succeeded() == 0
    assert backoff.failed() <= 1.0
