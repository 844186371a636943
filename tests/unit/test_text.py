"""The one way messages write values and counts (rabbit_retry.text)."""

from __future__ import annotations

from datetime import date

import pytest

from rabbit_retry.text import MAX_CHARS, clip, plural, shorten


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "null"),
        (True, "true"),
        (False, "false"),
        ({"a": 1}, "a mapping"),
        ([1, 2], "a list"),
        (date(2024, 5, 1), "2024-05-01 (a date)"),
        ("orders", "'orders'"),
        (5, "5"),
        (2.5, "2.5"),
    ],
)
def test_shorten_writes_a_value_as_yaml_would_say_it(value: object, shown: str) -> None:
    assert shorten(value) == shown


def test_shorten_and_clip_cut_long_text_in_the_middle() -> None:
    name = "q" * 100 + "-end"
    shown = shorten(name)
    assert len(shown) == MAX_CHARS
    assert shown.startswith("'qqq") and "..." in shown and shown.endswith("q-end'")
    assert clip("x" * MAX_CHARS) == "x" * MAX_CHARS
    assert clip(name) == name[:60] + "..." + name[-9:]


@pytest.mark.parametrize(
    ("count", "text"), [(0, "0 queues"), (1, "1 queue"), (2, "2 queues")]
)
def test_plural(count: int, text: str) -> None:
    assert plural(count, "queue") == text
