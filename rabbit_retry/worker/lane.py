"""One queue's consumer on one connection: how many deliveries run at once, and when a delivery
that came back runs alone.

A worker that dies returns every delivery it held, and the broker counts one return on each:
the innocent ones with the one that took the worker down. Left at that, the next crash returns
them all again, and a delivery limit parks (or dead-letters) the bystanders with the culprit.
So a lane keeps a crash charged to the one message that caused it:

- A delivery that came back without a verdict (``decide.runs_alone``) never runs beside
  another: it waits until nothing else runs, and nothing starts while it waits or runs.
- Holding deliveries is what exposes them to a crash, so once a suspect arrives the lane stops
  taking more (``basic.cancel``), settles what it holds, and then consumes one message at a time
  (QoS 1, "probation") until a delivery that did not come back arrives; then it goes back to the
  consumer's full prefetch.
- Every connection starts on probation: the returns of a crash are what the broker delivers
  first.

A crash while a suspect runs alone then returns that delivery and nothing else. Changing the
prefetch needs a new consumer: RabbitMQ applies a per-consumer QoS only to consumers created
after it. Probation ends while its one delivery is unsettled, so the cancelled consumer has no
credit and nothing can be in flight to it (a delivery in flight to a cancelled quorum consumer is
returned, or on 3.10 stranded on the channel: docs/versions.md).

A lane can also be *paused* (``pause``, a consumer's ``Pause``): its consumer is cancelled and
every delivery that has not started yet gets the turn ``"hold"`` (the session sends it back to
the queue unchanged) instead of running; ``resume`` consumes again at full prefetch. A ``fixed``
lane keeps its consumer while paused (cancelled, its single active consumer would go to another
worker while a key's message still runs here): a delivery that has not started waits, unacked,
until the lane resumes, a probe lets it run (``probe``: the one that has waited longest), the
lane stops, or it has waited ``PAUSED_WAIT`` seconds (then ``"hold"``: sent back, and it waits
again as the copy; the broker closes a channel whose delivery stays unacked for its consumer
timeout, 30 minutes by default).

The session asks for a delivery's turn (``enter``, or ``turn`` when it must wait), says when its
handler has run (``ran``) and when the delivery is gone (``left``): the rules live here, the
session's one coroutine per delivery carries them out. The lane's channel settles its
deliveries through one ``Settler`` (acks in groups), flushed before every cancel.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any, Literal

from aiormq.abc import AbstractChannel, DeliveredMessage

from rabbit_retry.worker.settle import Settler

log = logging.getLogger("rabbit_retry.worker")

Mode = Literal["probation", "full"]
# What a delivery may do: run beside others, run alone, go back to the queue unstarted (the
# lane is paused) or stay unstarted (the lane is stopping: the broker gets it back).
Turn = Literal["shared", "alone", "hold", "stopped"]
PROBATION_PREFETCH = 1
# How long a delivery waits unstarted on a paused fixed lane before it is sent back.
PAUSED_WAIT = 300.0

Task = asyncio.Task[Any]


class Lane:
    """Consumes ``queue`` on ``channel``, calling ``deliver(message)`` per delivery (as its own
    task, aiormq's), and gives each delivery its turn under the rules above; ``settle`` acks
    the channel's deliveries, ``ack_run`` of them at most in one frame.

    ``on_error`` hears of a failure to change consumers (the channel died): the session treats
    it as a lost connection.
    """

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        prefetch: int,
        ack_run: int,
        deliver: Callable[[DeliveredMessage], Coroutine[Any, Any, None]],
        on_error: Callable[[str], None],
        *,
        fixed: bool = False,
    ) -> None:
        self.channel = channel
        self.queue = queue
        self.prefetch = prefetch
        self.settle = Settler(channel, ack_run)
        self._deliver = deliver
        self._on_error = on_error
        self.paused = False
        # ``fixed``: one consumer for good, at full prefetch (an ordered queue's lane, whose
        # single active consumer a new consumer would hand to another worker mid-stream).
        self.fixed = fixed
        self.mode: Mode = "full" if fixed else "probation"
        self.tag: str | None = None
        self._target: Mode = self.mode
        self._mover: asyncio.Task[None] | None = None
        self._stopped = False
        self._held = 0  # deliveries received and not gone
        self._shared: set[Task] = set()  # the deliveries running side by side
        self._alone: Task | None = None  # a suspect running
        self._suspects = 0  # suspects waiting for their turn: nothing new starts meanwhile
        self._changed = asyncio.Event()
        self._waiting = 0  # deliveries and movers in ``_until``: a poke with none wakes no one
        # A paused fixed lane's unstarted deliveries (their message ids), longest waiting
        # first, and the one a probe picked.
        self._parked: dict[Task, str | None] = {}
        self._probe: Task | None = None

    async def start(self, paused: bool = False) -> None:
        """Consume (on probation), or stay paused: a pause outlives a reconnect (a fixed lane
        consumes, paused)."""
        if paused:
            self.paused = True
            if not self.fixed:
                return
        await self._consume(self.prefetch if self.fixed else PROBATION_PREFETCH)

    async def pause(self) -> None:
        """Cancel the consumer; what has not started gets the turn "hold" as it arrives or wakes
        (a fixed lane's waits instead)."""
        self.paused = True
        if self.fixed:
            self._poke()
            return
        await self._stop_mover()
        tag, self.tag = self.tag, None
        self._poke()  # waiting deliveries look again, and find the lane paused
        if tag is not None and not self._stopped:
            try:
                await self.settle.flush()
                await self.channel.basic_cancel(tag)
            except Exception as exc:  # the channel died: the session reconnects
                self._on_error(f"pausing the consumer of {self.queue!r} failed: {exc!r}")

    async def resume(self) -> None:
        """Consume again at full prefetch (a probe just succeeded: the queue is healthy)."""
        if not self.paused or self._stopped:
            return
        self.paused = False
        if self.fixed:
            self._poke()
            return
        self.mode = self._target = "full"
        try:
            await self._consume(self.prefetch)
        except Exception as exc:
            self._on_error(f"resuming the consumer of {self.queue!r} failed: {exc!r}")

    async def idle(self) -> None:
        """Until no delivery of this lane is held but those a pause keeps waiting."""
        await self._until(lambda: self._held == len(self._parked))

    def probe(self) -> str | None:
        """A paused fixed lane: let the delivery that has waited longest run; its message id
        ("" without one), or None when none waits."""
        if self._probe is not None or not self._parked:
            return None
        self._probe, message_id = next(iter(self._parked.items()))
        self._poke()
        return message_id or ""

    async def _stop_mover(self) -> None:
        if self._mover is not None and not self._mover.done():
            self._mover.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._mover

    async def stop(self, cancel_timeout: float) -> None:
        """No more deliveries: cancel the consumer. What runs goes on; what waits for its turn
        gets ``"stopped"`` (the broker gets it back when the channel closes).

        A ``fixed`` lane keeps its consumer: cancelled, a single active consumer hands its
        queue to another worker at once, which would start a key's next message while this one
        still runs the key's last; what arrives meanwhile stays unstarted and goes back with
        the channel, after the running handlers are done."""
        self._stopped = True
        self._poke()
        await self._stop_mover()
        if self.fixed:
            return
        tag, self.tag = self.tag, None
        if tag is not None:
            with suppress(Exception):
                await self.settle.flush()
                await self.channel.basic_cancel(tag, timeout=cancel_timeout)

    async def _consume(self, prefetch: int) -> None:
        await self.channel.basic_qos(prefetch_count=prefetch)
        # The tag is known before the broker answers: a consume cut short (a pause cancels the
        # mover) may still register the consumer, and ``pause`` or ``stop`` must cancel it.
        self.tag = f"rabbit-retry.{uuid.uuid4().hex}"
        await self.channel.basic_consume(self.queue, self._deliver, consumer_tag=self.tag)

    def _poke(self) -> None:
        if self._waiting:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self._waiting += 1
            try:
                await self._changed.wait()
            finally:
                self._waiting -= 1

    def _want(self, mode: Mode) -> None:
        if self.fixed:
            return
        self._target = mode
        if not self._stopped and not self.paused and (self._mover is None or self._mover.done()):
            self._mover = asyncio.create_task(self._move())

    async def _move(self) -> None:
        try:
            while self.mode != self._target and not self._stopped and not self.paused:
                target = self._target
                tag, self.tag = self.tag, None
                if tag is not None:
                    await self.settle.flush()
                    await self.channel.basic_cancel(tag)
                if target == "probation":
                    # Let every running handler finish before taking the next one alone
                    # (deliveries only settling, waiting for a copy's confirm, run no code).
                    await self._until(lambda: not self._shared and self._alone is None)
                if self._stopped or self.paused:
                    return
                await self._consume(PROBATION_PREFETCH if target == "probation" else self.prefetch)
                self.mode = target
                self._poke()
                log.debug("queue=%s: consuming with prefetch %s (%s)", self.queue,
                          PROBATION_PREFETCH if target == "probation" else self.prefetch, target)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel died under us: the session reconnects
            self._on_error(f"changing the consumer of {self.queue!r} failed: {exc!r}")
        finally:
            self._poke()  # a delivery waiting for the change goes on

    def enter(self, task: Task, alone: bool) -> bool:
        """A delivery arrived (``alone``: it came back without a verdict): whether it may run
        now, beside the others (most do). When not, ``turn`` says what it may do, once it may."""
        self._held += 1
        if (self.paused or alone or self._stopped or self._suspects
                or self._alone is not None or len(self._shared) >= self.prefetch
                or (self.mode == "probation" and self._target == "probation")):
            return False
        self._shared.add(task)
        return True

    async def turn(self, task: Task, alone: bool, message_id: str | None) -> Turn:
        """The turn of a delivery ``enter`` did not let run, waiting for it where it must."""
        if self._stopped:
            return "stopped"
        if self.paused and (waited := await self._paused_turn(task, message_id)) is not None:
            return waited
        if alone:
            return await self._alone_turn(task, message_id)
        if self.mode == "probation" and self._target == "probation":
            # Leave probation while this delivery is still unsettled: the probation consumer
            # then has no credit, so nothing can be on its way to it when it is cancelled.
            # Cancelled with a delivery in flight, RabbitMQ 4.x returns that delivery (4.0
            # and 4.2 count it as a return) and 3.10 keeps it on the channel, unsent, until
            # the channel closes (docs/versions.md).
            self._want("full")
            await self._until(lambda: self._stopped or self.mode == "full"
                              or self._mover is None or self._mover.done())
        if self._alone is not None or self._suspects or len(self._shared) >= self.prefetch:
            # Leaving probation holds one delivery more than the prefetch for a moment;
            # it waits, so no more than ``prefetch`` handlers ever run at once. Behind a
            # suspect waiting for its turn too: a fixed lane never stops taking deliveries, and
            # other keys starting one after another would keep it waiting for a lull.
            await self._until(
                lambda: self._stopped or self.paused
                or (self._alone is None and not self._suspects
                    and len(self._shared) < self.prefetch)
            )
            if self._stopped or self.paused:
                return self._not_started()
        self._shared.add(task)
        return "shared"

    async def _alone_turn(self, task: Task, message_id: str | None) -> Turn:
        """A returned delivery: into probation, then its turn once nothing else runs."""
        if self.mode == "full" and self._target == "full":
            log.info(
                "queue=%s message_id=%s came back without a verdict: handling returned"
                " messages one at a time",
                self.queue,
                message_id,
                extra={"queue": self.queue, "event": "probation"},
            )
            self._want("probation")
        self._suspects += 1
        try:
            await self._until(lambda: self._stopped or self.paused
                              or (self._alone is None and not self._shared))
        finally:
            self._suspects -= 1
            if not self._suspects:
                self._poke()  # the deliveries waiting behind suspects look again
        if self._stopped or self.paused:
            return self._not_started()
        self._alone = task
        return "alone"

    async def _paused_turn(self, task: Task, message_id: str | None) -> Turn | None:
        """Paused: ``"hold"``; a fixed lane waits, unstarted, for the lane to resume (None: the
        usual turn follows), a probe (``"shared"``), the stop, or ``PAUSED_WAIT`` to pass
        (``"hold"``)."""
        if not self.fixed:
            return "hold"
        self._parked[task] = message_id
        probed = False
        try:
            async with asyncio.timeout(PAUSED_WAIT):
                await self._until(lambda: self._stopped or not self.paused or self._probe is task)
        except TimeoutError:
            pass
        finally:
            del self._parked[task]
            if self._probe is task:
                self._probe, probed = None, True
        if self._stopped:
            return "stopped"
        if not self.paused:
            return None
        if probed:
            self._shared.add(task)
            return "shared"
        return "hold"

    def _not_started(self) -> Turn:
        """Stopping: it goes back to the broker unstarted; paused: back to the queue."""
        return "stopped" if self._stopped else "hold"

    def ran(self, task: Task) -> None:
        """The handler of ``task``'s delivery returned or raised (again: nothing happens).

        What remains (a confirmed copy, the ack) runs no user code. A copy can wait long for its
        confirm (its parking queue or tier missing); "running alone" is about handlers, so a
        returned delivery must not wait for such settling, or one returned message stalls the
        whole queue."""
        if task is self._alone:
            self._alone = None
            self._poke()
        elif task in self._shared:
            self._shared.discard(task)
            if not self._shared or self._held > self.prefetch:
                self._poke()

    def left(self, task: Task) -> None:
        """``task``'s delivery is settled, sent back or dropped."""
        self.ran(task)
        self._held -= 1
        if self._held == len(self._parked):  # what ``idle()`` waits for (0 unless paused)
            self._poke()
