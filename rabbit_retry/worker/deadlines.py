"""Handler timeouts of one consumer, all kept by one timer.

A timer per delivery (``loop.call_at``, cancelled when the handler returns) costs a handle, a
push onto the event loop's heap and a cancelled handle left there for every message. Here a
delivery only records its deadline; one timer is kept at the earliest deadline still running,
and when it fires every handler past its deadline is cancelled and the timer moves to the next
one. A timeout still fires at its deadline, not on a coarser tick.
"""

from __future__ import annotations

import asyncio
from math import inf
from typing import Any

_EXPIRED = -1.0  # the deadline of a task cancelled for its timeout


class Deadlines:
    __slots__ = ("_at", "_loop", "_running", "_timer")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[asyncio.Task[Any], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = inf  # when the timer fires

    def start(self, task: asyncio.Task[Any], seconds: float) -> None:
        """Cancel ``task`` once ``seconds`` pass, unless ``finish(task)`` comes first."""
        loop = task.get_loop()
        if loop is not self._loop:  # a new event loop (a test's, a new ``asyncio.run``)
            if self._timer is not None:
                self._timer.cancel()
            self._loop, self._running, self._timer, self._at = loop, {}, None, inf
        deadline = loop.time() + seconds
        self._running[task] = deadline
        if deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._fire)
            self._at = deadline

    def finish(self, task: asyncio.Task[Any]) -> bool:
        """Stop watching ``task``; whether it was cancelled because its deadline passed."""
        return self._running.pop(task, 0.0) == _EXPIRED

    def _fire(self) -> None:
        assert self._loop is not None
        self._timer, self._at = None, inf
        now = self._loop.time()
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
            self._timer = self._loop.call_at(following, self._fire)
            self._at = following
