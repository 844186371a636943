"""Pausing one queue while its downstream is failing (pure): ``Pause`` is what a consumer
declares, ``Breaker`` the state the worker keeps for it.

An outage makes every message fail; left alone, each one walks through the retry tiers and
parks. With ``pause = Pause(after=5)`` the worker stops taking the queue's messages after five
failures in a row, lets one message through every ``probe_every`` seconds, and resumes in full
on the first success. Only the failures that tripped it are charged to their messages: while
paused, a failure of the kind the pause watches sends its message back to the queue unchanged.

"In a row" counts distinct messages: one message failing again and again (a poison message
walking its tiers) is that message's problem, which its attempts and parking already handle,
not an outage, and must not stop the queue. A success resets the count; a failure of a kind the
pause does not watch, a ``Permanent`` error and an invalid body leave it as it is, but end a
pause: the downstream answered (so does a probe that finds the queue empty while another
replica consumes it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rabbit_retry.errors import InputError
from rabbit_retry.worker.checks import require_exception_types, require_seconds


@dataclass(frozen=True)
class Pause:
    """Stop consuming the queue after ``after`` failures in a row of distinct messages (of the
    types in ``on``; any transient failure when empty), probe every ``probe_every`` seconds."""

    after: int
    on: tuple[type[BaseException], ...] = ()
    probe_every: float = 10.0

    def check(self, owner: str) -> None:
        """``InputError`` in one line naming the first bad field."""
        after, on, every = self.after, self.on, self.probe_every
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise InputError(f"{owner}.pause.after: expected an integer >= 1, got {after!r}")
        require_exception_types(f"{owner}.pause.on", on)
        require_seconds(f"{owner}.pause.probe_every", every)

    def watches(self, error: BaseException) -> bool:
        """Whether a transient failure with ``error`` is the kind this pause counts."""
        return not self.on or isinstance(error, self.on)


class Change(enum.Enum):
    NONE = "none"
    PAUSED = "paused"
    RESUMED = "resumed"


@dataclass
class Breaker:
    """The running count of one consumer's ``Pause`` and whether it holds the queue now."""

    rule: Pause
    paused: bool = False
    since: float = 0.0  # when it paused (the worker's monotonic clock), for the resume's log
    _streak: set[str] = field(default_factory=set)

    def failed(self, message: str) -> Change:
        """A watched failure of the message identified by ``message`` (its id, or a digest)."""
        if self.paused:
            return Change.NONE
        self._streak.add(message)
        if len(self._streak) >= self.rule.after:
            self.paused = True
            self._streak.clear()
            return Change.PAUSED
        return Change.NONE

    def succeeded(self) -> Change:
        self._streak.clear()
        return self.answered()

    def answered(self) -> Change:
        """The downstream answered while the queue is paused: a probe's message failed for a
        reason the pause does not watch (``Permanent``, an invalid body, another exception),
        or found the queue empty while another replica consumes it. Resume: a queue that stays
        paused while it works would never resume otherwise."""
        if self.paused:
            self.paused = False
            return Change.RESUMED
        return Change.NONE

    @property
    def streak(self) -> int:
        return len(self._streak)
