"""The entries of an ordered lane's held queue, as messages: the contract between the worker
that keeps a lane (``worker/ordering.py`` says what each entry means and how a lane folds them)
and ``migrate``, which writes a gate into a new lane's held queue and a fence into each old lane
when it adds lanes (``broker/lane_changes.py``).

An entry is a message whose ``ordered-entry`` header names its kind; ``ordered-key`` and
``ordered-seq`` (the lane's sequence number) come with every kind, ``ordered-hold`` with every
kind but a message, ``ordered-lanes`` with the entries of a change of the queue's lanes. When
``migrate`` takes lanes away, a removed lane's fence and the ``passed`` entry it sends carry in
their body the keys it hands over (a JSON list of strings).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rabbit_retry.contract import (
    ORDERED_ENTRY,
    ORDERED_HOLD,
    ORDERED_HOLDER,
    ORDERED_KEY,
    ORDERED_LANES,
    ORDERED_SEQ,
    ORDERED_SINCE,
    ORDERED_WHY,
    as_text,
)

EntryKind = Literal["message", "hold", "release", "gate", "passed", "fence", "fenced"]
# The kinds a change of the queue's lanes writes; the other controls are a key's.
LANE_KINDS = frozenset({"gate", "passed", "fence", "fenced"})
MAX_SEQ = 2**63 - 1  # an AMQP signed 64-bit integer
_KINDS: dict[str, EntryKind] = {
    "message": "message", "hold": "hold", "release": "release", "gate": "gate",
    "passed": "passed", "fence": "fence", "fenced": "fenced",
}


def lane_list(lanes: Sequence[int]) -> str:
    """``ORDERED_LANES`` of a gate, a fence or a passed entry."""
    return ",".join(map(str, lanes))


def read_lanes(value: object) -> tuple[int, ...] | None:
    """The lanes ``ORDERED_LANES`` names, or None when garbled."""
    parts = (as_text(value) or "").split(",")
    if not all(part.isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def change_id(before: int, after: int) -> str:
    """The id of the change of a queue's lanes from ``before`` to ``after``."""
    return f"lanes {before} to {after}"


def change_sizes(change: str) -> tuple[int, int] | None:
    """The lanes before and after the change ``change`` (``change_id``); None if garbled."""
    found = re.fullmatch(r"lanes (\d+) to (\d+)", change)
    return None if found is None else (int(found[1]), int(found[2]))


def removes_lanes(change: str) -> bool:
    """Whether the change of lanes ``change`` takes lanes away."""
    sizes = change_sizes(change)
    return sizes is not None and sizes[1] < sizes[0]


def moved_hold(change: str, lane: int) -> str:
    """The hold by which a remaining lane holds the keys removed lane ``lane`` handed over in
    ``change``, until that lane releases each."""
    return f"{change}, from lane {lane}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a held queue (``worker/ordering.py`` says what each kind means)."""

    kind: EntryKind
    key: str
    seq: int
    hold: str | None = None  # a hold's or a release's hold id
    since: float = 0.0  # a hold's: when its key was held (epoch seconds)
    why: str = ""  # a hold's: retry | parked | sent-back
    holder: str | None = None  # a hold's: the holding message's message_id
    lanes: tuple[int, ...] = ()  # a gate's, a fence's, a passed entry's: the lanes it names
    keys: tuple[str, ...] = ()  # a removed lane's fence or passed entry: the keys it hands over

    def body(self) -> bytes:
        """The entry's body (a message entry keeps its own)."""
        import json  # only a change of the lanes writes keys

        return json.dumps(list(self.keys)).encode() if self.keys else b""

    def headers(self) -> dict[str, Any]:
        """The headers that mark a message as this entry (a message entry keeps its own)."""
        out: dict[str, Any] = {ORDERED_ENTRY: self.kind, ORDERED_KEY: self.key,
                               ORDERED_SEQ: self.seq}
        if self.hold is not None:
            out[ORDERED_HOLD] = self.hold
        if self.kind == "hold":
            out[ORDERED_SINCE] = self.since
            out[ORDERED_WHY] = self.why
            if self.holder is not None:
                out[ORDERED_HOLDER] = self.holder
        if self.kind in LANE_KINDS:
            out[ORDERED_LANES] = lane_list(self.lanes)
        return out


def read_entry(headers: Mapping[str, Any] | None, body: bytes = b"") -> Entry | None:
    """The entry a held queue's message is, or None when it is none (garbled, or put there by
    something else than a worker)."""
    if not headers:
        return None
    kind = _KINDS.get(as_text(headers.get(ORDERED_ENTRY)) or "")
    key = as_text(headers.get(ORDERED_KEY))
    seq = headers.get(ORDERED_SEQ)
    if key is None or kind is None:
        return None
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        return None
    hold = as_text(headers.get(ORDERED_HOLD))
    if kind != "message" and hold is None:
        return None
    change = _change_of(kind, headers, body)
    if change is None:
        return None
    since = headers.get(ORDERED_SINCE)
    return Entry(
        kind, key, seq, hold,
        float(since) if isinstance(since, int | float) and not isinstance(since, bool) else 0.0,
        as_text(headers.get(ORDERED_WHY)) or "",
        as_text(headers.get(ORDERED_HOLDER)),
        *change,
    )


def _change_of(
    kind: EntryKind, headers: Mapping[str, Any], body: bytes
) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The lanes and keys an entry of a change of the lanes names (none for the other kinds),
    or None when garbled."""
    lanes: tuple[int, ...] | None = ()
    if kind in LANE_KINDS and kind != "fenced":
        lanes = read_lanes(headers.get(ORDERED_LANES))
    keys: tuple[str, ...] | None = ()
    if kind in ("fence", "passed") and body:
        keys = _read_keys(body)
    return None if lanes is None or keys is None else (lanes, keys)


def _read_keys(body: bytes) -> tuple[str, ...] | None:
    """The keys a body lists, or None when garbled."""
    import json  # only a change of the lanes reads keys

    try:
        keys = json.loads(body)
    except ValueError:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return None
    return tuple(keys)
