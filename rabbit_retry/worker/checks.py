"""Checks of what a consumer declares, each refusing a bad value with one line that names the
attribute (``InputError``). Pure."""

from __future__ import annotations

import math

from rabbit_retry.errors import InputError


def require_seconds(where: str, value: object) -> None:
    """A positive, finite number of seconds (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InputError(f"{where}: expected a positive number of seconds, got {value!r}")


def require_exception_types(where: str, value: object) -> None:
    """A tuple of exception classes."""
    if not isinstance(value, tuple) or not all(
        isinstance(e, type) and issubclass(e, BaseException) for e in value
    ):
        raise InputError(f"{where}: expected a tuple of exception classes, got {value!r}")
