"""Which parked messages a replay or purge acts on: ``--where H=V`` and ``--older-than``; pure."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rabbit_retry.contract import PARKED_REASON, header_text, parked_reason
from rabbit_retry.parking.headers import parked_at
from rabbit_retry.topology.durations import label


@dataclass(frozen=True)
class Where:
    """``header`` equals ``value``, both compared as text (``retry-count=3`` matches int 3);
    ``parked-reason`` is the reason ``parking show`` gives (the broker's, from ``x-death``)."""

    header: str
    value: str

    def __str__(self) -> str:
        return f"{self.header}={self.value}"


def parse_where(text: str) -> Where:
    """``H=V`` -> Where; ``ValueError`` with a message fit for a user otherwise."""
    header, sep, value = text.partition("=")
    if not sep or not header.strip():
        raise ValueError(f"expected HEADER=VALUE (e.g. exception-type=TimeoutError), got {text!r}")
    return Where(header.strip(), value)


@dataclass(frozen=True)
class Selection:
    """All of ``wheres`` hold, and the message was parked more than ``older_than_ms`` before
    ``now``. A message whose ``parked-at`` cannot be read is never old enough: purge only deletes
    what it can date."""

    wheres: tuple[Where, ...] = ()
    older_than_ms: int | None = None
    now: datetime | None = None

    @property
    def everything(self) -> bool:
        return not self.wheres and self.older_than_ms is None

    @property
    def cutoff(self) -> datetime | None:
        if self.older_than_ms is None:
            return None
        if self.now is None:
            raise ValueError("a selection with older_than_ms needs now")
        return self.now - timedelta(milliseconds=self.older_than_ms)

    def matches(self, headers: Mapping[str, Any]) -> bool:
        for where in self.wheres:
            # A message the broker parked says why in its x-death, as `parking show` reads it.
            value = (parked_reason(headers) if where.header == PARKED_REASON
                     else header_text(headers.get(where.header)))
            if value != where.value:
                return False
        cutoff = self.cutoff
        if cutoff is not None:
            moment = parked_at(headers)
            if moment is None or moment >= cutoff:
                return False
        return True

    def describe(self) -> str:
        """``exception-type=KeyError and parked more than 2d ago``, or ``all``."""
        parts = [str(w) for w in self.wheres]
        if self.older_than_ms is not None:
            parts.append(f"parked more than {label(self.older_than_ms)} ago")
        return " and ".join(parts) or "all"


def selection(
    wheres: Iterable[str] = (), older_than: str | None = None, now: datetime | None = None
) -> Selection:
    """A Selection from the command line's words; ``ValueError`` names the bad one."""
    try:
        parsed = tuple(parse_where(w) for w in wheres)
    except ValueError as exc:
        raise ValueError(f"--where: {exc}") from None
    older_ms = None if older_than is None else parse_age(older_than)
    return Selection(parsed, older_ms, now)


def parse_age(text: str) -> int:
    """Milliseconds for ``--older-than``: the topology's duration units (``90m``, ``2d``) without
    its TTL ceiling, since a parked message may well be older than 49 days."""
    match = _AGE.match(text)
    if match is None or int(match[1]) == 0:
        raise ValueError(
            f"--older-than: bad duration {text!r}: use a positive whole number with ms, s, m, h "
            "or d (90m, 2d)"
        )
    return int(match[1]) * _AGE_UNITS_MS[match[2]]


_AGE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_AGE_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
