"""Waiting for something to happen (test-only): poll a check until it holds, within a generous
deadline. The deadline is how long to wait before giving up, never a statement about speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEADLINE_S = 120.0


def _gave_up(what: object, within: float, last: object) -> AssertionError:
    return AssertionError(f"gave up after {within:g}s waiting for {what} (last: {last!r})")


def wait_for(
    check: Callable[[], T],
    what: str,
    *,
    within: float = DEADLINE_S,
    interval: float = 0.1,
    unless: Callable[[], str | None] | None = None,
) -> T:
    """Poll ``check`` until it returns something truthy and return that; fail naming ``what``
    after ``within`` seconds, or at once when ``unless`` gives a reason to stop waiting (a
    process that died, say)."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        last = check()
        if last:
            return last  # type: ignore[no-any-return]
        if unless is not None and (reason := unless()):
            raise AssertionError(f"stopped waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise _gave_up(what, within, last)
        time.sleep(interval)


async def eventually(
    check: Callable[[], Any], *, within: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    """``wait_for`` for a test's event loop: ``check`` may be sync or async."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _gave_up(what or check, within, last)
        await asyncio.sleep(interval)
