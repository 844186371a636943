"""Durations as the file writes them (``250ms``, ``5s``, ``2m``, ``1h``, ``1d`` or an integer of
milliseconds) and their canonical label, which names a retry tier."""

from __future__ import annotations

import re

from rabbit_retry.text import shorten

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_LARGEST_FIRST = sorted(_UNITS_MS.items(), key=lambda kv: -kv[1])
# ASCII digits only: \d would also take other scripts' digits, which int() quietly accepts.
_PATTERN = re.compile(r"(-?)([0-9]+)(ms|s|m|h|d)")
# RabbitMQ runs TTLs on Erlang timers, which stop at 2^32 - 1 ms (about 49.7 days).
MAX_TTL_MS = 2**32 - 1
_HINT = "write a whole number and a unit (250ms, 5s, 2m, 1h, 1d) or an integer of milliseconds"


def parse_duration(value: object, *, limit_ms: int | None = MAX_TTL_MS) -> int:
    """Milliseconds for ``value``; ``ValueError`` with a message fit for a user otherwise.
    ``limit_ms`` is the longest allowed (a TTL's by default; None: no limit)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a duration, got {shorten(value)}: {_HINT}")
    if isinstance(value, int):
        ms = value
    else:
        match = _PATTERN.fullmatch(value)
        if match is None:
            raise ValueError(f"bad duration {value!r}: {_HINT}")
        sign, digits, unit = match.groups()
        if len(digits) > 15:  # far beyond the TTL limit; spares int() a pathological string
            raise ValueError(_too_long(value))
        ms = int(digits) * _UNITS_MS[unit] * (-1 if sign else 1)
    if ms <= 0:
        raise ValueError(f"a duration must be positive, got {shorten(value)}")
    if limit_ms is not None and ms > limit_ms:
        raise ValueError(_too_long(value))
    return ms


def label(ms: int) -> str:
    """The canonical label: the largest unit that divides ``ms`` exactly (1500ms, 90s, 2m)."""
    if isinstance(ms, bool) or not isinstance(ms, int) or ms <= 0:
        raise ValueError(f"a duration label needs a positive number of milliseconds, got {ms!r}")
    for unit, size in _LARGEST_FIRST:
        if ms % size == 0:
            return f"{ms // size}{unit}"
    raise AssertionError("unreachable: 1 ms divides every integer")


def _too_long(value: object) -> str:
    return f"duration {shorten(value)} is longer than RabbitMQ's TTL limit (about 49.7 days)"

