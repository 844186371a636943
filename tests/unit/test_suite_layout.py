"""The suite's own layout: one run collects every directory of tests/, so two test modules with
one name would clash at collection (pytest imports both as the same module), and the whole
stage would stop before running anything."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
