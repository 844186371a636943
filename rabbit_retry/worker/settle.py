"""Acks sent in groups: one ``basic.ack`` with ``multiple`` for a run of settled deliveries.

One frame per message is what limits an at-least-once consumer (a bare consumer acking every
100th delivery with ``multiple`` drains a queue about twice as fast as one acking each), so a
consuming channel's deliveries are settled through a ``Settler``:

- A delivery is *open* from its arrival until it is *done* (handled, or the copy that replaces
  it confirmed) or settled otherwise (``nack``, a confirmed copy... anything but an ack).
- A *run* is the open-free prefix of the channel's deliveries: every tag up to its last one is
  done or settled. One ``basic.ack(multiple=True)`` for the run's highest done tag acks them
  all. A delivery still running, waiting for its turn or being returned is open: its tag ends
  the run, so no ``multiple`` ack ever covers it.
- The run is sent when ``run`` deliveries are done and not acked, and otherwise once the
  channel has been quiet for ``LINGER_S`` (no delivery arrived or finished meanwhile), and at
  the latest ``STRAGGLER_S`` after the check started: under load runs fill up, a lone delivery
  is acked ``LINGER_S`` to twice that later, and one timer at a time is set per channel, none
  per message. (Sent at the first turn of the event loop without a delivery finishing, runs
  averaged under 7 deliveries, since the loop turns between reads of the socket; on a RabbitMQ
  4.3 quorum queue, 3,000 frames for 20,000 messages drained at 0.65 of a bare loop acking
  every 100th, 200-400 frames at 0.83-0.89: docs/worker-benchmark.md.) ``flush`` sends what
  can be sent at once, before anything that needs the channel's state known (a ``nack``, a
  cancel, a pause, a shutdown).
- A done delivery stuck behind an open one (a slow handler, a copy waiting for its confirm)
  waits ``STRAGGLER_S`` for the run to reach it, then is acked on its own (at once when the run
  is full): it must not hold a prefetch slot for the length of another's handler.

Crash cost: what was done but not yet acked comes back after a ``kill -9`` (an
``Idempotency`` consumer, which records a success before the ack, skips it): the run not sent
yet, and frames not yet written to the socket, typically under one run; never more than the
prefetch, which bounds every unacked delivery.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import insort
from collections import deque

from aiormq.abc import AbstractChannel

log = logging.getLogger("rabbit_retry.worker")


# How long a done delivery stuck behind an open one waits for the run to reach it before it is
# acked on its own: one timer per channel, not per message. Also the longest a run waits for the
# channel to go quiet.
STRAGGLER_S = 0.05
# How long the channel must be quiet (no delivery arriving or finishing) before a run that is not
# full is sent.
LINGER_S = 0.002


class Settler:
    __slots__ = ("_busy", "_channel", "_done", "_elsewhere", "_frames", "_open", "_quiet",
                 "_run", "_since", "_timer", "_writer")

    def __init__(self, channel: AbstractChannel, run: int) -> None:
        self._channel = channel
        self._run = max(1, run)
        self._open: deque[int] = deque()  # tags received and not yet acked or settled, in order
        self._done: set[int] = set()  # of those, the ones to ack
        self._elsewhere: set[int] = set()  # of those, settled some other way: never acked
        self._quiet: asyncio.TimerHandle | None = None  # the check that the channel is quiet
        self._since = 0.0  # when that check started
        self._busy = False  # a delivery arrived or finished since it last looked
        self._timer: asyncio.TimerHandle | None = None  # the stragglers' wait
        self._frames: deque[tuple[int, bool]] = deque()  # ack frames not yet handed over
        self._writer: asyncio.Future[None] | None = None

    def received(self, tag: int) -> None:
        """A delivery (or a ``basic.get``) arrived with ``tag``: open until settled."""
        if not self._open or tag > self._open[-1]:
            self._open.append(tag)
        else:  # a basic.get and a delivery racing; tags are still unique per channel
            insort(self._open, tag)
        self._busy = True

    def done(self, tag: int) -> None:
        """The delivery is done: ack it with the next run."""
        self._done.add(tag)
        if len(self._done) >= self._run:
            self._send(stragglers=True)
        elif self._quiet is not None:
            self._busy = True
        else:
            loop = asyncio.get_running_loop()
            self._busy = False
            self._since = loop.time()
            self._quiet = loop.call_later(LINGER_S, self._idle)

    def elsewhere(self, tag: int) -> None:
        """The delivery was settled without an ack (``nack``, ``reject``): skip it."""
        self._elsewhere.add(tag)

    def is_open(self, tag: int) -> bool:
        """Not settled yet (neither done nor settled otherwise)."""
        return tag not in self._done and tag not in self._elsewhere and tag in self._open

    async def flush(self) -> None:
        """Ack everything done now, and wait until the frames are written."""
        self._send(stragglers=True)
        await self.written()

    async def send_now(self, tag: int) -> None:
        """Ack ``tag`` (if done) now, with the run when the run reaches it, else on its own, and
        wait until its frame is written; the other done deliveries keep to their run."""
        if tag in self._done:
            self._send(stragglers=False)
            if tag in self._done:  # behind an open one
                self._done.discard(tag)
                self._ack_alone(tag)
        await self.written()

    async def written(self) -> None:
        """Until every ack frame queued so far is written."""
        if self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    def waiting(self, tag: int) -> bool:
        """Done, its ack not sent yet."""
        return tag in self._done

    @property
    def pending(self) -> int:
        """Done deliveries not acked yet."""
        return len(self._done)

    def _idle(self) -> None:
        loop = asyncio.get_running_loop()
        if self._busy and loop.time() - self._since < STRAGGLER_S:
            # deliveries still arriving or finishing: the run grows; look again
            self._busy = False
            self._quiet = loop.call_later(LINGER_S, self._idle)
            return
        self._quiet = None
        if self._done:
            self._send(stragglers=False)

    def _late(self) -> None:
        self._timer = None
        if self._done:
            self._send(stragglers=True)

    def _send(self, *, stragglers: bool) -> None:
        """Ack the run; the done deliveries behind an open one go alone with ``stragglers``,
        else once they have waited ``STRAGGLER_S`` for the run to reach them."""
        open_, done, elsewhere = self._open, self._done, self._elsewhere
        top = None
        while open_:
            tag = open_[0]
            if tag in done:
                done.discard(tag)
                top = tag
            elif tag in elsewhere:
                elsewhere.discard(tag)
            else:
                break
            open_.popleft()
        if top is not None:
            self._ack(top, multiple=True)
        if not done:
            if self._quiet is not None:  # nothing left to wait for
                self._quiet.cancel()
                self._quiet = None
            return
        if stragglers:
            for tag in sorted(done):
                self._ack_alone(tag)
            done.clear()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(STRAGGLER_S, self._late)

    def _ack_alone(self, tag: int) -> None:
        self._elsewhere.add(tag)  # acked: the run skips it when it gets there
        self._ack(tag, multiple=False)

    def _ack(self, tag: int, *, multiple: bool) -> None:
        """Queue an ack frame. One writer sends them in order: frames of separate tasks can
        overtake each other in aiormq's bounded write queue, and a ``multiple`` ack overtaken by
        a later one names a tag the broker no longer holds (it closes the channel)."""
        if self._channel.is_closed:
            return  # the broker has every unacked delivery back already
        self._frames.append((tag, multiple))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        frames = self._frames
        while frames:
            tag, multiple = frames.popleft()
            try:
                # Handed to the connection's write queue in order, each without waiting to reach
                # the socket (the writer would fall behind), but for the last: once it is
                # written, every one before it is, and ``flush`` may close the channel.
                await self._channel.basic_ack(tag, multiple=multiple, wait=not frames)
            except Exception as exc:
                # The channel closed under the ack: its deliveries go back to the broker, and
                # the session reconnects (it watches the channel).
                log.debug("an ack could not be sent: %r", exc)
                frames.clear()
