"""One lane of an ordered queue on one session: each key's messages one after another, a held key's
later messages moved to the lane's held queue, and the passes over that queue that hand them
back in order once their key is free. ``ordering`` (pure) says what the held queue means; this
module reads and writes it, and the session asks it at three points of a delivery's way:

- ``admit`` as the delivery arrives: run it now (its key's earlier message is done), move it to
  the held queue (its key is held, or has messages waiting there), drop it (a holder's copy
  whose hold is over, or that is here already; a delivery back from a crash whose own copy
  holds its key or waits in the held queue) or take it as an operator's release;
- ``hold`` / ``record`` / ``release`` while its action is carried out: a copy that goes to a
  tier, to parking (``on_park: hold``) or back to the queue holds the key; the holder handled
  (or parked with ``on_park: continue``) releases it;
- ``left`` once the delivery is settled: the key's next message may run.

The first delivery a lane gets on a session (the broker made this worker its single active
consumer) waits until the held queue was read once; only the lane's active consumer ever reads
or writes its held queue.

When ``migrate`` adds lanes (``ordering``'s gate, fence and passed entries), a new lane moves
every delivery to its held queue until each lane before it has passed; a lane that gets a fence
settles everything before it, waits until no key it held then is held, and sends ``passed``.
When it takes lanes away, a remaining lane gets its gate in the lane itself; a removed lane
that gets its fence settles everything before it and passes at once, handing over the keys it
still holds, which it releases one by one as they go on here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from aiormq import spec
from aiormq.abc import AbstractChannel, DeliveredMessage

from rabbit_retry.contract import (
    ORDERED_ENTRY,
    ORDERED_HOLD,
    ORDERED_KEY,
    ORDERED_LANE,
    ORDERED_LANES,
    ORDERED_RELEASE,
    as_text,
    new_message_id,
    republish_properties,
)
from rabbit_retry.held import (
    Entry,
    change_sizes,
    lane_list,
    moved_hold,
    read_entry,
    removes_lanes,
)
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.resolved import OrderedConfig
from rabbit_retry.worker import shutdown
from rabbit_retry.worker.history import History
from rabbit_retry.worker.ordering import (
    Folded,
    Hold,
    HoldWhy,
    Settled,
    fingerprint,
    fold,
    key_of,
    lane_mark,
    plan,
)
from rabbit_retry.worker.publisher import Publisher, Unroutable
from rabbit_retry.worker.settle import Settler

log = logging.getLogger("rabbit_retry.worker")

Task = asyncio.Task[Any]
# Entries a pass writes back at once (each confirmed before its read one is acked).
REWRITE_WINDOW = 100
# Keys settled and not yet confirmed by a round trip beyond which one starts unasked.
UNCONFIRMED_CAP = 1024


@dataclass(slots=True)
class Turn:
    """A delivery admitted to run: its key, and the hold it is the holder of (None: none)."""

    key: str
    hold: str | None = None


class OrderedLane:
    """Lane ``lane`` of the ordered queue ``queue``, consumed on ``channel`` and settled by
    ``settle``; ``handle(message, key)`` runs a released message from the held queue through
    the session like any delivery."""

    def __init__(
        self,
        *,
        config: OrderedConfig,
        queue: str,
        number: int,
        lane_queue: str,
        held_queue: str,
        lanes_exchange: str,
        channel: AbstractChannel,
        settle: Settler,
        publisher: Publisher,
        user: str,
        handle: Callable[[DeliveredMessage, str], Awaitable[None]],
        lost: Callable[[str], None],
        settled: Settled,
    ) -> None:
        self.config = config
        self.queue = queue
        self.number = number
        self.lane_queue = lane_queue
        self.held_queue = held_queue
        self.lanes_exchange = lanes_exchange
        self.channel = channel
        self.settle = settle
        self.publisher = publisher
        self.user = user
        self._handle = handle
        self._lost = lost
        self.settled = settled  # this lane's, kept by the worker process across connections
        self.holds: dict[str, Hold] = {}
        self.backlog: dict[str, int] = {}  # per key: its messages waiting in the held queue
        self._last: dict[str, str] = {}  # per key: the message id of the last one waiting
        self.turns: dict[Task, Turn] = {}  # the running deliveries' keys
        self._tails: dict[str, asyncio.Future[None]] = {}  # per key: its last admitted delivery
        # Per key: the tags of its deliveries settled here whose acks the broker may not have
        # taken yet. An ack may wait in a run, or be written and still be lost with a SIGKILL
        # (the system drops what it had not sent), so the key's next message waits until the
        # ack is sent and a round trip on the channel was answered after it (``_confirmed``).
        self._unconfirmed: dict[str, list[int]] = {}
        self._syncing: set[str] = set()  # the keys the round trip under way covers
        self._sync: asyncio.Future[None] | None = None
        self._mine: dict[Task, asyncio.Future[None]] = {}
        # The holds whose holder was admitted and has not left: a second copy of one (Q's
        # forward written twice, its ack lost with a connection) would run beside it.
        self._admitted: set[str] = set()
        self._seq = 0
        self._pending: dict[str, Hold | None] = {}  # holds set or ended, not yet written
        self._writes = asyncio.Lock()  # a pass's read sees every write that went before it
        self._ready = asyncio.Event()  # the held queue was read: deliveries may be admitted
        # Deliveries waiting for a read of the held queue, let through in the order they came.
        # Counted, not read from the lock: between a release and the woken waiter's acquire the
        # lock says unlocked, and a delivery arriving then must still queue behind that waiter.
        self._gate = asyncio.Lock()
        self._at_gate = 0
        self._passes: asyncio.Task[None] | None = None
        self._again = False
        # Entries written that no longer say anything (a release, the hold it ended, a hold
        # replaced): a pass drops them once they are as many as the entries still needed, so
        # the held queue stays small and a pass costs about one read per entry written.
        self._garbage = 0
        # A change of the queue's lanes under way here (module docstring): per change, the
        # lanes this new lane still waits for; per change, the lanes an open fence is for and
        # the keys held (or with messages waiting) when it came, which must all go on first.
        self.gates: dict[str, set[int]] = {}
        self.fences: dict[str, tuple[tuple[int, ...], set[str]]] = {}
        self._fencing: asyncio.Task[None] | None = None
        self._shut_since = 0.0  # when this worker found the lane gated
        # Lanes taken away: the changes whose ``passed`` this removed lane sent (in this process:
        # a new one sends it again, which counts once), and the round trip that confirms the
        # ack of a gate that came in the lane (a pass is taken only after it: the gate must
        # never come back once its change is over here).
        self._announced: set[str] = set()
        self._gate_acked: asyncio.Future[None] | None = None
        # The holds of the keys a removed lane hands over, while the passed entry that holds
        # them here is being written: done once it is.
        self._passing: dict[str, asyncio.Future[None]] = {}

    # --- a delivery's way ----------------------------------------------------------------------

    def done(self, message: DeliveredMessage) -> None:
        """The delivery is settled (its ack is on its way): remembered, in case the broker
        loses the ack and hands it back."""
        props = message.header.properties
        self.settled.add(fingerprint(props.message_id, message.body, props.headers))
        turn = self.turns.get(asyncio.current_task())  # type: ignore[arg-type]
        if turn is not None:
            self._settled(turn.key, _tag(message))

    def _settled(self, key: str, tag: int) -> None:
        self._unconfirmed.setdefault(key, []).append(tag)
        if len(self._unconfirmed) > UNCONFIRMED_CAP and (self._sync is None or self._sync.done()):
            self._round_trip()  # keys that do not come back: confirm them, keep the map small

    async def _confirmed(self, key: str) -> None:
        """Until the broker has taken the acks of the key's deliveries settled here: each
        ack sent now (with its run when the run reaches it, else alone; the other done
        deliveries keep to their runs) and a round trip on the channel answered after it (the
        broker handles a channel's frames in order). An ack only written may still be lost
        with a SIGKILL, and the delivery would come back after its key's next one ran."""
        for tag in list(self._unconfirmed.get(key, ())):
            if self.settle.waiting(tag):
                await self.settle.send_now(tag)
        while key in self._unconfirmed or key in self._syncing:
            if self._sync is None or self._sync.done():
                self._round_trip()
            assert self._sync is not None
            await asyncio.shield(self._sync)

    def _round_trip(self) -> None:
        """One round trip covering every key whose ack is sent by now (a key whose ack still
        waits in its run waits for a later one)."""
        sent = {k for k, tags in self._unconfirmed.items()
                if not any(self.settle.waiting(t) for t in tags)}
        for key in sent:
            del self._unconfirmed[key]
        self._syncing = sent
        self._sync = asyncio.ensure_future(self._answered())
        self._sync.add_done_callback(_retrieved)

    async def _answered(self) -> None:
        try:
            await self.settle.written()
            await self.channel.queue_declare(self.lane_queue, passive=True)
        finally:
            self._syncing = set()

    def settled_before(self, message: DeliveredMessage) -> bool:
        """Whether a delivery the broker handed back was settled by this process already (its
        ack was lost with a broker restart or a dropped connection): then it is acked again,
        not run after its key's later messages."""
        if not message.delivery.redelivered:  # type: ignore[union-attr]
            return False
        props = message.header.properties
        if fingerprint(props.message_id, message.body, props.headers) not in self.settled:
            return False
        log.info("queue=%s message_id=%s came back although it was settled here (the broker lost"
                 " its ack); acked again, not handled again", self.lane_queue, props.message_id,
                 extra={"queue": self.queue, "event": "settled_before"})
        return True

    async def admit(
        self, task: Task, message: DeliveredMessage, history: History, ours: bool
    ) -> Turn | None:
        """Whether the delivery runs now (its ``Turn``), after its key's earlier delivery, or
        was taken care of here (moved to the held queue, dropped, a release, settled here
        before: acked; None)."""
        if not self._ready.is_set() or self._at_gate:
            await self._after_the_read()
        headers = message.header.properties.headers
        tag: int = message.delivery.delivery_tag  # type: ignore[union-attr,assignment]
        if self.settled_before(message):
            await self._ack(tag)  # its key's next message waits until the broker took it
            self._settled(self._key(message, history, ours), tag)
            return None
        if (entry := self._lane_entry(message, ours)) is not None:
            await self._lane_change(entry, tag)
            return None
        key = self._key(message, history, ours)
        hold, released = _marks(headers, ours)
        if released is not None:  # an operator discarded the holder (or a nudge: "")
            if released and self._holding(key) == released:
                await self.release(key, released)
            if (passing := self._passing.get(released)) is not None:
                # A removed lane's release of a key its passed entry hands over, come while that
                # entry waits: acked once the passed entry is written, or a crash in between
                # would leave the next worker to hold the key again, with no release to come.
                await asyncio.shield(passing)
            await self._ack(tag)
            return None
        holder = None if hold is None else self._holder(task, key, hold)
        dropped = holder is None if hold is not None else self._copied(key, message)
        if dropped:
            await self._ack(tag)
            return None
        try:
            # A holder waits behind the key's last delivery too, and its ack taken (the one
            # that failed may still wait in its run); the key's next one waits behind the
            # holder until it left, its release written: a crash before that would run the
            # holder again after it.
            await self._behind(task, key)
            if holder is not None:
                return holder
            if key in self.holds or self.backlog.get(key) or self.gates:
                await self._defer(key, message, history)
            else:
                turn = self.turns[task] = Turn(key)
                return turn
        except BaseException:  # cancelled or failed: the key's next one must not wait on it
            self.left(task)
            raise
        self.left(task)
        return None

    def _key(self, message: DeliveredMessage, history: History, ours: bool) -> str:
        routing_key = (history.source[1] if history.source
                       else message.delivery.routing_key or "")  # type: ignore[union-attr]
        return key_of(self.config.header, message.header.properties.headers, routing_key, ours)

    def _holder(self, task: Task, key: str, hold: str) -> Turn | None:
        """A copy holding ``key`` by ``hold`` is back: its turn, first of its key; None when it
        is to be dropped (its hold ended, or a copy of it is here already)."""
        if self._holding(key) == hold and hold not in self._admitted:
            self._admitted.add(hold)
            turn = self.turns[task] = Turn(key, hold)
            return turn
        if hold in self._admitted:
            log.info("queue=%s key=%r: a second copy of hold %s (forwarded twice); dropped, the"
                     " first runs", self.queue, key, hold,
                     extra={"queue": self.queue, "event": "stale_holder"})
        else:
            log.info("queue=%s key=%r: a copy of hold %s came back after its hold ended (a crash"
                     " left it behind); dropped, its message was handled", self.queue, key, hold,
                     extra={"queue": self.queue, "event": "stale_holder"})
        return None

    def _copied(self, key: str, message: DeliveredMessage) -> bool:
        """Whether a delivery the broker handed back has a copy here already: the copy a hold
        read from the held queue names (a hold is written once its copy is confirmed), or the
        last of its key's messages waiting in the held queue. The worker died before the
        broker took its ack: acked, not moved behind that copy to run a second time."""
        message_id = message.header.properties.message_id
        if not message_id or not message.delivery.redelivered:  # type: ignore[union-attr]
            return False
        hold = self.holds.get(key)
        if hold is not None and hold.holder == message_id and key not in self._pending:
            where = f"holds its key (hold {hold.id})"
        elif self.backlog.get(key) and self._last.get(key) == message_id:
            where = "waits in the held queue"
        else:
            return False
        log.info("queue=%s message_id=%s came back, and its copy %s: acked, the copy runs it",
                 self.queue, message_id, where,
                 extra={"queue": self.queue, "event": "copied_before"})
        return True

    async def _after_the_read(self) -> None:
        """Until the held queue was read, behind every delivery that came before and waits for
        it too: one that arrives as a read ends must not take its key's turn before an earlier
        one of the key that waited for the read has woken (a kill test on 4.0 ran a key's
        second message before its first so)."""
        self._at_gate += 1
        try:
            async with self._gate:
                if not self._ready.is_set():
                    self._start_passes()
                    await self._ready.wait()
        finally:
            self._at_gate -= 1

    async def _behind(self, task: Task, key: str) -> None:
        """Until the key's earlier delivery is settled and the broker has taken its ack."""
        mine = asyncio.get_running_loop().create_future()
        earlier = self._tails.get(key)
        self._tails[key] = mine
        self._mine[task] = mine
        if earlier is not None and not earlier.done():
            await asyncio.shield(earlier)
        await self._confirmed(key)

    def left(self, task: Task) -> None:
        """The delivery is settled (or gone): its key's next delivery may run."""
        turn = self.turns.pop(task, None)
        if turn is not None and turn.hold is not None:
            self._admitted.discard(turn.hold)
        mine = self._mine.pop(task, None)
        if mine is None:
            return
        mine.set_result(None)
        key = turn.key if turn is not None else next(
            (k for k, f in self._tails.items() if f is mine), None)
        if key is not None and self._tails.get(key) is mine:
            del self._tails[key]

    def _holding(self, key: str) -> str | None:
        hold = self.holds.get(key)
        return hold.id if hold is not None else None

    async def _defer(self, key: str, message: DeliveredMessage, history: History) -> None:
        """Move a held key's delivery to the held queue (confirmed), then ack it."""
        from rabbit_retry.worker import copies  # loaded by the first held key

        props = message.header.properties
        deliver: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
        source = history.source or (deliver.exchange or "", deliver.routing_key or "")
        headers = copies.retry_headers(props.headers, retry_count=history.failures,
                                       original=source, expiration=props.expiration)
        async with self._writes:
            entry = Entry("message", key, self._next())
            headers.update(entry.headers())
            await self._write(message.body,
                              republish_properties(props, headers, self.user, expiration=None),
                              lambda: not message.channel.is_closed)
        self.backlog[key] = self.backlog.get(key, 0) + 1
        if props.message_id:
            self._last[key] = props.message_id
        else:  # a message without an id cannot be told from another
            self._last.pop(key, None)
        await self._ack(deliver.delivery_tag)  # type: ignore[arg-type]
        self.done(message)
        # It has no turn: its key is marked here, so its copy runs once the broker has taken
        # this ack (``_hand_back``).
        self._settled(key, deliver.delivery_tag)  # type: ignore[arg-type]

    # --- holds ---------------------------------------------------------------------------------

    def turn_of(self, task: Task) -> Turn | None:
        return self.turns.get(task)

    def ours(self, exchange: str | None, routing_key: str | None) -> bool:
        """Whether a delivery came by this queue's own route: from the lanes exchange, or
        straight into the lane or its held queue (a released or rewritten message)."""
        return exchange == self.lanes_exchange or (
            not exchange and routing_key in (self.held_queue, self.lane_queue))

    def before_copy(
        self, turn: Turn, action: object, headers: dict[str, Any], holder: str | None
    ) -> Hold | None:
        """A copy of the delivery with ``turn`` is about to go out (a retry, a park, a send
        back): it says its key, and holds it unless it parks on a queue that continues. A
        holding copy also names this lane: it comes back here, where its hold is written."""
        from rabbit_retry.worker.decide import Park, Requeue

        headers[ORDERED_KEY] = turn.key
        why: HoldWhy = ("parked" if isinstance(action, Park)
                        else "sent-back" if isinstance(action, Requeue) else "retry")
        if why == "parked" and self.config.on_park != "hold":
            headers.pop(ORDERED_HOLD, None)
            headers.pop(ORDERED_LANE, None)
            return None
        hold = self.hold(turn.key, why, holder)
        headers[ORDERED_HOLD] = hold.id
        # (a lane being taken away is past the file's lanes: its copies must still come back)
        headers[ORDERED_LANE] = lane_mark(self.number, max(self.config.lanes, self.number + 1))
        return hold

    async def after_copy(self, turn: Turn, hold: Hold | None) -> None:
        """The copy is confirmed: write its hold, or (parked to continue) let the key go on."""
        if hold is not None:
            await self.record(turn.key, hold)
        elif turn.hold is not None:
            await self.release(turn.key, turn.hold)

    async def after_ack(self, turn: Turn | None) -> None:
        """The delivery was handled: if it held its key, the key goes on."""
        if turn is not None and turn.hold is not None:
            await self.release(turn.key, turn.hold)

    def hold(self, key: str, why: HoldWhy, holder: str | None, hold_id: str | None = None) -> Hold:
        """A new hold of ``key``, in force at once (its copy may come back before it is
        written); ``record`` writes it once the copy is confirmed, ``forget`` takes it back."""
        hold = Hold(hold_id or new_message_id(), -1, time.time(), why, holder)
        if key in self.holds:
            self._garbage += 1
        self.holds[key] = hold
        self._pending[key] = hold
        return hold

    def forget(self, key: str, hold: Hold) -> None:
        """The holder's copy was not published: no hold."""
        if self.holds.get(key) is hold:
            del self.holds[key]
        if self._pending.get(key) is hold:
            del self._pending[key]

    async def record(self, key: str, hold: Hold) -> None:
        """Write ``hold`` to the held queue (before the holder's delivery is acked)."""
        async with self._writes:
            entry = Entry("hold", key, self._next(), hold.id, hold.since, hold.why, hold.holder)
            await self._write_entry(entry)
            if self._pending.get(key) is hold:
                del self._pending[key]

    async def release(self, key: str, hold_id: str) -> None:
        """The holder of ``hold_id`` is done (handled, parked to continue, discarded): write the
        release, then the key's waiting messages are handed back by a pass."""
        current = self.holds.get(key)
        if current is not None and current.id == hold_id:
            del self.holds[key]
        self._pending[key] = None
        async with self._writes:
            await self._write_entry(Entry("release", key, self._next(), hold_id))
            if self._pending.get(key) is None:
                self._pending.pop(key, None)
        self._garbage += 2
        if (self.backlog.get(key) and not self.gates) or self._untidy():
            self._start_passes()
        self._check_fences()

    def _untidy(self) -> bool:
        """Whether the held queue holds as many entries that say nothing as entries needed."""
        return self._garbage > 0 and self._garbage >= len(self.holds) + sum(self.backlog.values())

    async def _ack(self, tag: int) -> None:
        """Ack with the lane's next run."""
        self.settle.done(tag)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    async def _write_entry(self, entry: Entry) -> None:
        properties = spec.Basic.Properties(headers=entry.headers(), delivery_mode=2,
                                           message_id=new_message_id())
        await self._write(entry.body(), properties, lambda: not self.channel.is_closed)

    async def _write(self, body: bytes, properties: spec.Basic.Properties,
                     alive: Callable[[], bool]) -> None:
        await self.publisher.publish_held(
            "", self.held_queue, body, properties, delivery_alive=alive,
            context={"queue": self.queue, "message_id": properties.message_id},
        )

    # --- passes over the held queue ------------------------------------------------------------

    def _start_passes(self) -> None:
        if self._passes is None or self._passes.done():
            self._passes = asyncio.create_task(self._run_passes())
        else:
            self._again = True

    async def _run_passes(self) -> None:
        try:
            while True:
                self._again = False
                await self._one_pass()
                # Free keys whose messages were moved meanwhile (behind those handed back), or
                # entries released while this pass handed back others: once those are gone,
                # nothing else may come to tidy the held queue.
                waiting = not self.gates and any(
                    n and key not in self.holds for key, n in self.backlog.items())
                if not (self._again or waiting or self._untidy()):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel died: the session reconnects and reads again
            self._lost(f"reading the held queue {self.held_queue!r} failed: {exc!r}")

    async def _one_pass(self) -> None:
        """Read the held queue whole, then keep, drop or hand back each entry (``plan``)."""
        self._ready.clear()
        try:
            async with self._writes:
                taken = await self._take_all()
                entries = [read_entry(m.header.properties.headers, m.body) for m in taken]
                folded = fold(entries)
                self._seq = max(self._seq, folded.top)
                todo = plan(entries, folded)
                holds = dict(folded.holds)
                for key, pending in self._pending.items():  # set or ended, being written
                    if pending is None:
                        holds.pop(key, None)
                    else:
                        holds[key] = pending
                self.holds = holds
                self.backlog = {key: len(indexes) for key, indexes in folded.waiting.items()}
                self._last = {key: message_id for key, indexes in folded.waiting.items()
                              if (message_id := taken[indexes[-1]].header.properties.message_id)}
                self._garbage = 0
                self._changes(folded)
        finally:
            self._ready.set()
        for index in todo.drop:
            await self._ack(_tag(taken[index]))
        kept = [taken[index] for index in todo.keep]
        # In windows: the order they land in does not matter, each keeps its sequence number.
        for start in range(0, len(kept), REWRITE_WINDOW):
            await asyncio.gather(*map(self._rewrite, kept[start:start + REWRITE_WINDOW]))
        runs = [self._hand_back(key, [taken[i] for i in indexes])
                for key, indexes in todo.handle.items()]
        if runs:
            await asyncio.gather(*runs)
        self._check_fences()

    async def _take_all(self) -> list[DeliveredMessage]:
        """Every entry, taken until the held queue says it is empty, not as many as it counts:
        a quorum queue counts what it has applied, and entries a dead owner had taken come
        back with a command it may not have applied yet when this worker takes the lane over
        (their takes queue behind that command). Only this lane's owner writes here, and not
        while it reads."""
        taken: list[DeliveredMessage] = []
        while True:
            message = await self.channel.basic_get(self.held_queue, no_ack=False)
            if not isinstance(message.delivery, spec.Basic.GetOk):
                break
            # Open at once: a multiple ack of the lane's other deliveries must not cover it.
            self.settle.received(_tag(message))
            taken.append(message)
        return taken

    async def _rewrite(self, message: DeliveredMessage) -> None:
        """Write an entry again at the end of the held queue (same headers, same sequence
        number), then ack the one read."""
        props = message.header.properties
        await self._write(message.body,
                          republish_properties(props, dict(props.headers or {}), self.user),
                          lambda: not message.channel.is_closed)
        await self._ack(_tag(message))

    async def _hand_back(self, key: str, messages: list[DeliveredMessage]) -> None:
        """A free key's waiting messages, in order; once one holds the key again, the rest
        stay in the held queue, even if that holder comes back and is done before this loop
        is (the next pass hands them back, behind it)."""
        held = False
        for message in messages:
            held = held or key in self.holds
            if held:
                await self._rewrite(message)
                continue
            if self.settled_before(message):
                await self._ack(_tag(message))
            else:
                await self._confirmed(key)  # the holder's, or the one handed back before
                await self._handle(message, key)
            self.backlog[key] = max(0, self.backlog.get(key, 0) - 1)
        if not self.backlog.get(key):
            self.backlog.pop(key, None)
            self._last.pop(key, None)

    # --- a change of the queue's lanes ----------------------------------------------------------

    def _changes(self, folded: Folded) -> None:
        """What the held queue says of changes of the lanes under way (a pass read it)."""
        if folded.gates and not self.gates:
            awaited = sorted(set().union(*folded.gates.values()))
            log.info("queue=%s lane %d is new: it runs nothing until lanes %s say they passed",
                     self.queue, self.number, lane_list(awaited),
                     extra={"queue": self.queue, "event": "lane_gated"})
        self.gates = {change: set(lanes) for change, lanes in folded.gates.items()}
        self._shut_since = (self._shut_since or time.time()) if self.gates else 0.0
        busy = set(folded.holds) | set(folded.waiting)
        self.fences = {
            change: self.fences.get(change, (lanes, set(handed) if removes_lanes(change) else busy))
            for change, (lanes, handed) in folded.fences.items()}

    @staticmethod
    def _lane_entry(message: DeliveredMessage, ours: bool) -> Entry | None:
        """The gate, fence or passed entry the delivery is, put straight into this lane; else
        None."""
        headers = message.header.properties.headers
        if not (ours and headers and ORDERED_ENTRY in headers) or message.delivery.exchange:  # type: ignore[union-attr]
            return None
        entry = read_entry(headers, message.body)
        return entry if entry is not None and entry.kind in ("gate", "fence", "passed") else None

    async def _lane_change(self, entry: Entry, tag: int) -> None:
        """Carry out a gate, fence or passed entry that came in the lane, then ack it."""
        if entry.kind == "gate":
            await self._shut(entry)
            await self._ack(tag)
            self._gate_acked = asyncio.ensure_future(self._ack_taken(tag))
            self._gate_acked.add_done_callback(_retrieved)
            return
        await (self._fence(entry) if entry.kind == "fence" else self._passed(entry))
        await self._ack(tag)

    async def _ack_taken(self, tag: int) -> None:
        """Until the broker has taken the ack of ``tag``: sent now, and a round trip answered."""
        if self.settle.waiting(tag):
            await self.settle.send_now(tag)
        await self.settle.written()
        await self.channel.queue_declare(self.lane_queue, passive=True)

    async def _shut(self, entry: Entry) -> None:
        """``migrate`` takes lanes away: until each removed lane it names has passed, this lane
        moves every delivery to its held queue (at once: the deliveries behind the gate were
        routed after it, and may be of keys the removed lanes still have messages of)."""
        change = entry.hold or ""
        if change in self.gates:
            return  # a second gate, or one this lane found in its held queue
        self.gates[change] = set(entry.lanes)
        self._shut_since = self._shut_since or time.time()
        log.info("queue=%s lane %d: lanes %s are being taken away; it runs nothing until they "
                 "passed", self.queue, self.number, lane_list(entry.lanes),
                 extra={"queue": self.queue, "event": "lane_gated"})
        async with self._writes:
            await self._write_entry(Entry("gate", "", self._next(), change, lanes=entry.lanes))

    async def _fence(self, entry: Entry) -> None:
        """A fence ``migrate`` put into this lane after binding new ones: once everything that
        came before it is settled (and the broker has taken the acks), it is written to the held
        queue; the lane passes once the keys it holds now go on (``_check_fences``)."""
        change = entry.hold or ""
        if change in self.fences:
            return
        earlier = [tail for tail in self._tails.values() if not tail.done()]
        if earlier:
            await asyncio.wait([asyncio.shield(tail) for tail in earlier])
        await self.settle.flush()
        await self.channel.queue_declare(self.lane_queue, passive=True)  # acks taken
        keys = self._busy()
        handed = tuple(sorted(keys)) if removes_lanes(change) else ()
        async with self._writes:
            await self._write_entry(Entry("fence", "", self._next(), change, lanes=entry.lanes,
                                          keys=handed))
        self.fences[change] = (entry.lanes, keys)
        log.info("queue=%s lane %d fenced for lanes %s (%s); %s to go on first", self.queue,
                 self.number, lane_list(entry.lanes), change, plural(len(keys), "held key"),
                 extra={"queue": self.queue, "event": "lane_fenced"})
        self._check_fences()

    async def _passed(self, entry: Entry) -> None:
        """Lanes before this new one passed: written to the held queue; once all have, the
        messages moved here meanwhile are handed back in order."""
        change = entry.hold or ""
        waits = self.gates.get(change)
        if not waits or not waits & set(entry.lanes):
            return  # passed before (a duplicate), or not a change this lane waits for
        # A removed lane's keys: held at once (their releases may come right behind, and be
        # taken while this waits), each written before the passed entry.
        handed = {key: self.hold(key, "moved", None, moved_hold(change, lane))
                  for lane in entry.lanes for key in entry.keys if key not in self.holds}
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ids = [moved_hold(change, lane) for lane in entry.lanes]
        self._passing.update(dict.fromkeys(ids, written))
        try:
            await self._write_passed(change, entry, handed)
        finally:
            for hold_id in ids:
                if self._passing.get(hold_id) is written:
                    del self._passing[hold_id]
            written.set_result(None)
        if not self.gates:
            log.info("queue=%s lane %d: every lane before it passed (%s); it runs", self.queue,
                     self.number, change, extra={"queue": self.queue, "event": "lane_opened"})
            self._start_passes()

    async def _write_passed(self, change: str, entry: Entry, handed: dict[str, Hold]) -> None:
        """The handed-over keys still held, then the passed entry, written to the held queue
        (once the gate's ack is taken)."""
        if self._gate_acked is not None:
            await asyncio.shield(self._gate_acked)
        async with self._writes:
            holds = [Entry("hold", key, self._next(), hold.id, hold.since, hold.why)
                     for key, hold in handed.items()
                     if self.holds.get(key) is hold]  # (not released meanwhile)
            for start in range(0, len(holds), REWRITE_WINDOW):
                await asyncio.gather(*map(self._write_entry, holds[start:start + REWRITE_WINDOW]))
            for key, hold in handed.items():
                if self._pending.get(key) is hold:
                    del self._pending[key]
            await self._write_entry(Entry("passed", "", self._next(), change, lanes=entry.lanes))
            # (a pass may have read the held queue meanwhile: its gates are the ones now)
            waits = self.gates.get(change, set())
            waits -= set(entry.lanes)
            if not waits:
                self.gates.pop(change, None)

    def _busy(self) -> set[str]:
        """The keys held, or with messages waiting in the held queue."""
        return set(self.holds) | {key for key, n in self.backlog.items() if n}

    def _passable(self) -> list[str]:
        """The open fences with something to do: one that adds lanes once none of its keys is
        busy any more; one that takes this lane away until it announced its pass, then each
        time one of the keys it handed over is free, and once none is left."""
        busy = self._busy()
        return [change for change, (_, keys) in self.fences.items()
                if (change not in self._announced or not keys or keys - busy
                    if removes_lanes(change) else not keys & busy)]

    def _check_fences(self) -> None:
        """Pass each fence whose keys have all gone on, in a task of its own."""
        if self._passable() and (self._fencing is None or self._fencing.done()):
            self._fencing = asyncio.create_task(self._pass_fences())

    async def _last_ran(self, key: str) -> None:
        """Until the key's running deliveries ended and the broker took their acks."""
        while running := [t for t, turn in self.turns.items() if turn.key == key]:
            await asyncio.wait(running)
        await self._confirmed(key)

    async def _send(self, lane: int, entry: Entry | dict[str, Any]) -> None:
        """An entry (or a release's headers) straight into lane ``lane``, confirmed."""
        headers, body = ((entry.headers(), entry.body()) if isinstance(entry, Entry)
                         else (entry, b""))
        await self.publisher.publish(
            "", naming.lane_queue(self.queue, lane), body,
            spec.Basic.Properties(headers=headers, delivery_mode=2, message_id=new_message_id()))

    async def _hand_over(self, change: str) -> None:
        """This lane is taken away: it passes with the keys it still holds, then releases each
        of them in the remaining lanes once it is free here; ``fenced`` once none is left."""
        lanes, keys = self.fences[change]
        if change not in self._announced:
            passed = Entry("passed", "", 0, change, lanes=(self.number,), keys=tuple(sorted(keys)))
            for lane in lanes:
                await self._send(lane, passed)
            self._announced.add(change)
            log.info("queue=%s lane %d is taken away (%s): passed to lanes %s, handing over %s",
                     self.queue, self.number, change, lane_list(lanes), plural(len(keys), "key"),
                     extra={"queue": self.queue, "event": "lane_passed"})
        for key in sorted(keys - self._busy()):
            await self._last_ran(key)
            if key in self._busy():
                continue
            released: dict[str, Any] = {ORDERED_KEY: key,
                                        ORDERED_RELEASE: moved_hold(change, self.number)}
            for lane in lanes:
                await self._send(lane, released)
            keys.discard(key)
        if not keys:
            await self._fenced(change)

    async def _fenced(self, change: str) -> None:
        sizes = change_sizes(change)
        if sizes is not None and sizes[1] < sizes[0]:
            # Said in the change's marker, for ``migrate`` to delete this lane (before
            # ``fenced``: a crash in between says it again, which counts once).
            marker = naming.lanes_change_queue(self.queue, *sizes)
            done: dict[str, Any] = {ORDERED_ENTRY: "fenced", ORDERED_LANES: str(self.number)}
            with suppress(Unroutable):  # the change is over (a lane a crash left behind)
                await self.publisher.publish("", marker, b"", spec.Basic.Properties(
                    headers=done, delivery_mode=2, message_id=new_message_id()))
        async with self._writes:
            await self._write_entry(Entry("fenced", "", self._next(), change))
        self.fences.pop(change, None)
        self._garbage += 2
        if self._untidy():
            self._start_passes()

    async def _pass_fences(self) -> None:
        try:
            while passable := self._passable():
                change = passable[0]
                if removes_lanes(change):
                    await self._hand_over(change)
                    continue
                lanes, keys = self.fences[change]
                # The keys' last messages have run and the broker took their acks: a crash
                # after ``passed`` must not hand one back to run after the key's next, which
                # the new lane runs from then on.
                for key in keys:
                    await self._last_ran(key)
                if change not in self._passable():
                    continue  # a key is busy again meanwhile
                passed = Entry("passed", "", 0, change, lanes=(self.number,))
                for lane in lanes:
                    await self._send(lane, passed)
                await self._fenced(change)
                log.info("queue=%s lane %d passed to lanes %s (%s)", self.queue, self.number,
                         lane_list(lanes), change,
                         extra={"queue": self.queue, "event": "lane_passed"})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel died: the session reconnects and reads again
            self._lost(f"passing the fence of lane {self.lane_queue!r} failed: {exc!r}")

    def summary(self) -> tuple[int, float | None]:
        """Held keys now, and since when the oldest is held (epoch seconds; None: none). While
        the lane is gated, every key with messages in its held queue is held, since then."""
        # A key a removed lane handed over counts there (every lane before it holds it too:
        # none can tell which one the ring gives it).
        holds = [h for h in self.holds.values() if h.why != "moved"]
        oldest = min((h.since for h in holds), default=None)
        if not self.gates:
            return len(holds), oldest
        busy = {k for k in self._busy() if k not in self.holds or self.holds[k].why != "moved"}
        return len(busy), min(oldest or self._shut_since, self._shut_since)

    async def stop(self) -> None:
        for task in (self._passes, self._fencing):
            if task is not None and not task.done():
                await shutdown.cancel([task])
                with suppress(asyncio.CancelledError, Exception):
                    await task
        self._passes = self._fencing = None


def _marks(headers: Any, ours: bool) -> tuple[str | None, str | None]:
    """The hold a copy that came by the queue's own route holds, and the hold it releases."""
    if not (ours and headers):
        return None, None
    return as_text(headers.get(ORDERED_HOLD)), as_text(headers.get(ORDERED_RELEASE))


def _retrieved(future: asyncio.Future[None]) -> None:
    """A round trip nobody waited for: its failure (the channel closed) is the session's to see."""
    if not future.cancelled():
        future.exception()


def _tag(message: DeliveredMessage) -> int:
    return message.delivery.delivery_tag  # type: ignore[union-attr,return-value]
