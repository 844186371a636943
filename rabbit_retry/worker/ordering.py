"""Ordered keys (README, "Ordered keys"): which key a message belongs to, and the held queue's
log that says which keys wait and what waits with them (pure).

Each lane of an ordered queue is consumed by one worker at a time (single active consumer) and
that worker handles each key's messages one after another. When a message cannot be done now
(it goes to a retry tier, to parking with ``on_park: hold``, or back to its queue), its key is
*held*: until that message (the *holder*) comes back and is handled, every later message of the
key is moved to the lane's held queue instead of running, so nothing of the key sits unacked for
the length of a delay and nothing of it overtakes the holder. The held queue is the lane's
memory, always written (and confirmed) before the delivery it concerns is acked:

- a ``hold`` entry: the key is held by hold ``h``; its holder carries ``ordered-hold: h``;
- a ``release`` entry: hold ``h`` ended (its holder was handled, or an operator discarded it);
- a ``message`` entry: a later message of a held key, a copy of the delivery as it arrived.

Each entry has a sequence number, increasing in the order the lane wrote them. A worker that
takes a lane over reads the whole held queue once (``fold``): per key, the last hold or release
says whether it is held and by which hold; its messages, by sequence and each once, are what
waits. Each time keys are released the worker reads the held queue again and ``plan`` says what
becomes of each entry: kept (written again at the end: the key is still held), handled (its key
is free: in sequence order, before anything newer of the key) or dropped (a release, a hold
that ended, a duplicate that a crash left behind).

A change of the queue's lanes (``migrate`` adds lanes; keys move only to the new ones) adds four
kinds, each naming the change:

- a ``gate`` entry, written by ``migrate`` into a new lane's held queue before the lane exists:
  the lane runs nothing (every delivery is moved to its held queue) until it has a ``passed``
  entry from each lane it names (every lane before it: a key it takes over may have earlier
  messages in any of them);
- a ``passed`` entry: a lane said it has settled everything that came before the change
  (received as a message in the new lane, written here before it is acked);
- a ``fence`` entry: ``migrate`` published a fence into this lane after binding the new ones
  (everything before it in the lane was routed before the change); the lane settles all that
  came before it, then waits until none of the keys it held (or kept messages of) at that
  moment is held any more, sends ``passed`` to each lane the fence names and writes ``fenced``.

``migrate`` takes lanes away (the last ones: the ring keeps the others' buckets) with the same
kinds, the other way round:

- a ``gate`` arrives in each remaining lane itself, before the removed lanes are unbound: the
  lane writes it here, and from then on moves every delivery to its held queue until each
  removed lane has passed (only as long as those lanes take to settle what came before their
  fences: they do not wait for their held keys);
- a removed lane's ``fence`` names the remaining lanes; the lane settles all that came before
  it, writes the fence with the keys it still holds (or keeps messages of) in its body, and
  sends ``passed`` with those keys to each remaining lane at once. A remaining lane holds each
  handed-over key (a ``hold`` whose id names the change and the removed lane: ``held.moved_hold``)
  before it writes the ``passed``. The removed lane goes on with those keys (their retries and
  parked copies come back to it) and, as each is free, sends its release to every remaining
  lane; once none is left it writes ``fenced``.

Why this keeps order through crashes: a holder's copy is confirmed before its hold is written,
and the hold before the delivery is acked. A crash before the hold leaves the delivery to be
handled again in place and its copy without a hold (*stale*: dropped when it comes back); a
crash after it leaves the delivery to be moved behind its own hold, handled again after the
holder and before anything later. Duplicates an interrupted rewrite leaves carry the same
sequence number and count once.

How an entry is written on a message, and read back: ``rabbit_retry/held.py``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rabbit_retry.contract import ORDERED_KEY, ORDERED_LANE, as_text, header_text
from rabbit_retry.held import LANE_KINDS, Entry

HoldWhy = Literal["retry", "parked", "sent-back", "moved"]


def key_of(
    header: str | None, headers: Mapping[str, Any] | None, routing_key: str, ours: bool
) -> str:
    """The key of a message: on a copy rabbit-retry made (``ours``: it came through a route only
    rabbit-retry publishes to), the ``ordered-key`` it carries; else the value of the header
    the queue names (``header``; absent: the empty key) or the routing key."""
    if ours and headers:
        carried = as_text(headers.get(ORDERED_KEY))
        if carried is not None:
            return carried
    if header is None:
        return routing_key
    return header_text((headers or {}).get(header)) or ""


def lane_mark(lane: int, lanes: int) -> str:
    """``ORDERED_LANE`` of a holding copy from lane ``lane`` of ``lanes``."""
    return f"{lane}/{lanes}"


def holding_lane(headers: Mapping[str, Any], lanes: int) -> int | None:
    """The lane a copy back at ``Q`` returns to: the one whose held queue has its hold (a
    holder's copy, replayed or released, carries it), also when the queue got more lanes since
    (its hold is still there) and when the copy was written by a worker on a file with more
    lanes than ``lanes`` (a worker still on the old file while ``migrate``'s added lanes are
    taken up, or a lane ``migrate`` is taking away: deleted only once no key is held for it);
    None (through the lanes exchange): none carried, garbled, or a lane neither knows (a copy
    naming a lane deleted meanwhile goes through the exchange too, as an unroutable one)."""
    lane, sep, count = (as_text(headers.get(ORDERED_LANE)) or "").partition("/")
    if not (sep and lane.isdigit() and count.isdigit()):
        return None
    return int(lane) if int(lane) < max(lanes, int(count)) else None


@dataclass(frozen=True, slots=True)
class Hold:
    """A held key: by which hold, since when, why, and which message holds it."""

    id: str
    seq: int
    since: float
    why: str
    holder: str | None = None


@dataclass
class Folded:
    """What a held queue says: the held keys, and per key the indexes of its waiting messages in
    sequence order (each sequence number once); ``top`` the highest sequence number in it.
    ``gates``: per change of the lanes, the lanes this one still waits for (only those that
    wait); ``fences``: per change, the lanes an open fence is for and the keys it hands over
    (a removed lane's)."""

    holds: dict[str, Hold] = field(default_factory=dict)
    waiting: dict[str, list[int]] = field(default_factory=dict)
    top: int = -1
    gates: dict[str, set[int]] = field(default_factory=dict)
    fences: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)

    @property
    def gated(self) -> bool:
        return bool(self.gates)


def fold(entries: Sequence[Entry | None]) -> Folded:
    """The state ``entries`` (a held queue read from its head, ``None`` for a foreign message)
    add up to, whatever order a crash left them in."""
    folded = Folded()
    controls: dict[str, list[Entry]] = {}
    messages: dict[str, dict[int, int]] = {}
    changes: list[Entry] = []
    for index, entry in enumerate(entries):
        if entry is None:
            continue
        folded.top = max(folded.top, entry.seq)
        if entry.kind == "message":
            messages.setdefault(entry.key, {}).setdefault(entry.seq, index)
        elif entry.kind in LANE_KINDS:
            changes.append(entry)
        else:
            controls.setdefault(entry.key, []).append(entry)
    folded.gates, folded.fences = _fold_changes(changes)
    for key, written in controls.items():
        hold: Hold | None = None
        for entry in sorted(written, key=lambda e: e.seq):
            assert entry.hold is not None
            if entry.kind == "hold":
                hold = Hold(entry.hold, entry.seq, entry.since, entry.why, entry.holder)
            elif hold is not None and hold.id == entry.hold:
                hold = None
        if hold is not None:
            folded.holds[key] = hold
    folded.waiting = {key: [seqs[s] for s in sorted(seqs)] for key, seqs in messages.items()}
    return folded


def _fold_changes(
    entries: Sequence[Entry],
) -> tuple[dict[str, set[int]], dict[str, tuple[tuple[int, ...], tuple[str, ...]]]]:
    """Per change of the lanes, the lanes a gate still waits for (only those that wait), and
    the lanes an open fence is for with the keys it hands over."""
    awaited: dict[str, set[int]] = {}
    passed: dict[str, set[int]] = {}
    fences: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    fenced: set[str] = set()
    for entry in entries:
        change = entry.hold or ""
        if entry.kind == "gate":
            awaited.setdefault(change, set()).update(entry.lanes)
        elif entry.kind == "passed":
            passed.setdefault(change, set()).update(entry.lanes)
        elif entry.kind == "fence":
            fences.setdefault(change, (entry.lanes, entry.keys))
        else:
            fenced.add(change)
    gates = {change: lanes - passed.get(change, set()) for change, lanes in awaited.items()}
    return ({change: left for change, left in gates.items() if left},
            {change: lanes for change, lanes in fences.items() if change not in fenced})


@dataclass
class PassPlan:
    """What one pass over a held queue does with each entry it read (by index)."""

    keep: list[int] = field(default_factory=list)  # written again at the end, then acked
    drop: list[int] = field(default_factory=list)  # acked
    handle: dict[str, list[int]] = field(default_factory=dict)  # per free key, in order


def entry_id(entry: Entry) -> tuple[str, str, tuple[int, ...]]:
    """What makes two entries of a change of the lanes the same entry."""
    return entry.kind, entry.hold or "", entry.lanes


def _under_way(entry: Entry, folded: Folded) -> bool:
    """Whether a gate, a passed entry or a fence still says something here."""
    change = entry.hold or ""
    if entry.kind in ("gate", "passed"):
        return change in folded.gates
    return entry.kind == "fence" and change in folded.fences


def plan(entries: Sequence[Entry | None], folded: Folded) -> PassPlan:
    """What becomes of each entry: a held key's messages and its current hold are kept, a free
    key's messages handled in order, everything else dropped; a foreign message is kept (never
    dropped: the held queue is no place to lose one). While the lane is gated every message is
    kept and none handled; a gate, a passed entry or a fence is kept (once) while its change is
    under way here."""
    out = PassPlan()
    waiting = {index for indexes in folded.waiting.values() for index in indexes}
    current = {hold.seq for hold in folded.holds.values()}
    kept_holds: set[int] = set()
    kept_lanes: set[tuple[str, str, tuple[int, ...]]] = set()  # (entry_id)
    for index, entry in enumerate(entries):
        if entry is None:
            out.keep.append(index)
        elif entry.kind in LANE_KINDS:
            kept = _under_way(entry, folded) and entry_id(entry) not in kept_lanes
            if kept:
                kept_lanes.add(entry_id(entry))
            (out.keep if kept else out.drop).append(index)
        elif entry.kind == "hold":
            if entry.seq in current and entry.seq not in kept_holds:
                kept_holds.add(entry.seq)
                out.keep.append(index)
            else:
                out.drop.append(index)
        elif entry.kind == "release" or index not in waiting:
            out.drop.append(index)  # a release is folded in; a duplicate counts once
        elif entry.key in folded.holds or folded.gated:
            out.keep.append(index)
    for key, indexes in folded.waiting.items():
        if key not in folded.holds and not folded.gated:
            out.handle[key] = list(indexes)
    return out


# --- what a lane settled on an earlier connection ------------------------------------------------
# A broker that restarts, or a connection that drops, can lose acks the worker had written: the
# broker hands those deliveries back although they were handled, and a key's later messages may
# have run since. The worker process remembers what each lane settled, so such a delivery is
# acked again instead of being handled after its key's later messages.

# What a quorum queue adds to a delivery it hands back (4.x: both; 3.x: the first).
RETURN_COUNTS = frozenset({"x-delivery-count", "x-acquired-count"})


def fingerprint(
    message_id: str | None, body: bytes, headers: Mapping[str, Any] | None
) -> bytes | None:
    """What tells a delivery that comes back from every other message: its id, body and headers
    (a retry's copy differs from its original by its headers); None without a message id (two
    such messages may be alike: neither is ever taken for the other)."""
    if not message_id:
        return None
    digest = hashlib.blake2b(body, digest_size=16)
    digest.update(message_id.encode())
    kept = sorted((k, v) for k, v in (headers or {}).items() if k not in RETURN_COUNTS)
    digest.update(repr(kept).encode())
    return digest.digest()


class Settled:
    """The fingerprints of the last ``size`` deliveries a lane settled in this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Oldest first; an OrderedDict drops its first item at once, where a dict's first key
        # is found past every slot deleted before it (a cost that grows with ``size``).
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def add(self, print_: bytes | None) -> None:
        if print_ is None:
            return
        self._seen[print_] = None
        self._seen.move_to_end(print_)
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def __contains__(self, print_: bytes | None) -> bool:
        return print_ is not None and print_ in self._seen
