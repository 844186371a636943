"""Handler timeouts of one consumer, all kept by one timer.

A timer per delivery (``loop.call_at``, cancelled when the handler returns) costs a handle, a
push onto the event loop's heap and a cancelled handle left there for every message. Here a
delivery only records its deadline; one timer is kept at the earliest deadline still running,
and when it fires every handler past its deadline is cancelled and the timer moves to the next
one. A timeout still fires at its deadline, not on a coarser tick. Deadlines are read on
``time.monotonic`` (a C call; ``loop.time()`` is a Python method on top of it) and the timer is
set with ``call_later``, so any event loop's own clock works.
"""

from __future__ import annotations

import asyncio
from math import inf
from time import monotonic
from typing import Any

from rabbit_retry.worker.consumer import HandlerTimeout

_EXPIRED = -1.0  # the deadline of a task cancelled for its timeout


class Deadlines:
    __slots__ = ("_at", "_loop", "_running", "_timer")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[asyncio.Task[Any], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = inf  # when the timer fires

    def start(self, task: asyncio.Task[Any], seconds: float) -> None:
        """Cancel ``task`` once ``seconds`` pass, unless ``ended(task, ...)`` comes first."""
        deadline = monotonic() + seconds
        loop = task.get_loop()
        if loop is not self._loop:  # a new event loop (a test's, a new ``asyncio.run``)
            if self._timer is not None:
                self._timer.cancel()
            self._loop, self._running, self._timer, self._at = loop, {}, None, inf
        self._running[task] = deadline
        if deadline < self._at:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(deadline - monotonic(), self._fire)
        self._at = deadline

    def ended(
        self, task: asyncio.Task[Any], raised: BaseException | None, seconds: float
    ) -> BaseException | None:
        """Stop watching ``task``, whose handler returned (``raised`` None) or raised
        ``raised``; what that end stands for.

        If its deadline cancelled it, that cancellation is taken back (``uncancel``): a
        ``CancelledError`` that was ours alone becomes a ``HandlerTimeout``, one that someone
        else asked for too (a shutdown) stays a cancellation, and a handler that swallowed the
        cancellation and returned keeps its result.
        """
        if self._running.pop(task, 0.0) != _EXPIRED:
            return raised
        if task.uncancel() == 0 and isinstance(raised, asyncio.CancelledError):
            return HandlerTimeout(
                f"the handler did not finish within {seconds:g}s"
            ).with_traceback(raised.__traceback__)
        return raised

    def _fire(self) -> None:
        self._timer, self._at = None, inf
        now = monotonic()
        following = inf
        for task, deadline in self._running.items():
            if deadline == _EXPIRED:
                continue
            if deadline <= now:
                self._running[task] = _EXPIRED
                task.cancel()
            elif deadline < following:
                following = deadline
        if following < inf:
            self._arm(following)
