"""Durations: what the file may write, the milliseconds it means, and the label naming a tier."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rabbit_retry.topology.durations import MAX_TTL_MS, label, parse_duration


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("250ms", 250),
        ("1500ms", 1_500),
        ("5s", 5_000),
        ("90s", 90_000),
        ("2m", 120_000),
        ("1h", 3_600_000),
        ("1d", 86_400_000),
        ("49d", 49 * 86_400_000),
        ("0005s", 5_000),
        (1, 1),
        (60_000, 60_000),
        (MAX_TTL_MS, MAX_TTL_MS),
    ],
)
def test_parse(text: object, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize(
    ("ms", "expected"),
    [
        (1, "1ms"),
        (250, "250ms"),
        (1_500, "1500ms"),
        (1_000, "1s"),
        (90_000, "90s"),
        (120_000, "2m"),
        (5_400_000, "90m"),
        (3_600_000, "1h"),
        (36 * 3_600_000, "36h"),
        (86_400_000, "1d"),
        (MAX_TTL_MS, "4294967295ms"),
    ],
)
def test_label_uses_the_largest_whole_unit(ms: int, expected: str) -> None:
    assert label(ms) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0s", "a duration must be positive, got '0s'"),
        (0, "a duration must be positive, got 0"),
        ("0ms", "a duration must be positive, got '0ms'"),
        ("-5s", "a duration must be positive, got '-5s'"),
        (-1, "a duration must be positive, got -1"),
        ("1.5s", "bad duration '1.5s': write a whole number and a unit"),
        ("5", "bad duration '5': write a whole number and a unit"),
        ("5 s", "bad duration '5 s'"),
        (" 5s", "bad duration ' 5s'"),
        ("5S", "bad duration '5S'"),
        ("5sec", "bad duration '5sec'"),
        ("s", "bad duration 's'"),
        ("", "bad duration ''"),
        # Arabic-Indic five: int() would take it, the file may not
        ("\u0665s", "bad duration '\u0665s'"),
        (1.5, "expected a duration, got 1.5"),
        (5.0, "expected a duration, got 5.0"),
        (True, "expected a duration, got true"),
        (False, "expected a duration, got false"),
        (None, "expected a duration, got null"),
        (["5s"], "expected a duration, got a list"),
        ("50d", "duration '50d' is longer than RabbitMQ's TTL limit (about 49.7 days)"),
        (MAX_TTL_MS + 1, "duration 4294967296 is longer than RabbitMQ's TTL limit"),
        ("9" * 30 + "ms", "is longer than RabbitMQ's TTL limit"),
    ],
)
def test_rejects(value: object, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_duration(value)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("ms", [0, -1, True, 1.5])
def test_label_refuses_what_is_not_a_duration(ms: object) -> None:
    with pytest.raises(ValueError, match="positive number of milliseconds"):
        label(ms)  # type: ignore[arg-type]


@given(st.integers(min_value=1, max_value=MAX_TTL_MS))
def test_label_round_trips(ms: int) -> None:
    text = label(ms)
    assert parse_duration(text) == ms
    assert label(parse_duration(text)) == text


@given(st.integers(min_value=1, max_value=MAX_TTL_MS))
def test_label_is_the_largest_unit_that_divides(ms: int) -> None:
    text = label(ms)
    number = int(text.rstrip("mshd"))
    unit = text[len(str(number)) :]
    sizes = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    larger = [size for size in sizes.values() if size > sizes[unit]]
    assert all(ms % size != 0 for size in larger)


@given(
    st.integers(min_value=1, max_value=10_000),
    st.sampled_from(["ms", "s", "m", "h", "d"]),
)
def test_every_spelling_of_a_duration_has_one_label(number: int, unit: str) -> None:
    sizes = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    ms = number * sizes[unit]
    if ms > MAX_TTL_MS:
        return
    assert parse_duration(f"{number}{unit}") == ms == parse_duration(ms)
    assert label(parse_duration(f"{number}{unit}")) == label(ms)
