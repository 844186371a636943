"""One queue's consumer on one connection: how many deliveries run at once, and when a delivery
that came back runs alone.

A worker that dies returns every delivery it held, and the broker counts one return on each:
the innocent ones with the one that took the worker down. Left at that, the next crash returns
them all again, and a delivery limit parks (or dead-letters) the bystanders with the culprit.
So a lane keeps a crash charged to the one message that caused it:

- A delivery that came back without a verdict (``redelivery.is_suspect``) never runs beside
  another: it waits until nothing else runs, and nothing starts while it runs.
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
every delivery that has not started yet is handed to ``hold`` (which sends it back to the queue
unchanged) instead of the handler; ``resume`` consumes again at full prefetch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from contextvars import ContextVar
from typing import Literal

from aiormq.abc import AbstractChannel, DeliveredMessage

from rabbit_retry.worker.redelivery import is_suspect

log = logging.getLogger("rabbit_retry.worker")

Mode = Literal["probation", "full"]
PROBATION_PREFETCH = 1

# The running delivery's way to tell its lane that its handler has finished (``handler_done``).
_release: ContextVar[Callable[[], None] | None] = ContextVar("rabbit_retry_lane_release",
                                                               default=None)


def handler_done() -> None:
    """Called by the session once the handler of the current delivery returned or raised: what
    remains (a confirmed copy, the ack) runs no user code. A copy can wait long for its confirm
    (its parking queue or tier missing); "running alone" is about handlers, so a returned
    delivery must not wait for such settling, or one returned message stalls the whole queue."""
    release = _release.get()
    if release is not None:
        release()


class Lane:
    """Consumes ``queue`` on ``channel`` and calls ``handle`` per delivery under the rules above.

    ``on_error`` hears of a failure to change consumers (the channel died): the session treats
    it as a lost connection.
    """

    def __init__(
        self,
        channel: AbstractChannel,
        queue: str,
        queue_type: str,
        prefetch: int,
        handle: Callable[[DeliveredMessage], Awaitable[None]],
        on_error: Callable[[str], None],
        hold: Callable[[DeliveredMessage], Awaitable[None]] | None = None,
    ) -> None:
        self.channel = channel
        self.queue = queue
        self.queue_type = queue_type
        self.prefetch = prefetch
        self._handle = handle
        self._on_error = on_error
        self._hold = hold
        self.paused = False
        self.mode: Mode = "probation"
        self.tag: str | None = None
        self._target: Mode = "probation"
        self._mover: asyncio.Task[None] | None = None
        self._stopped = False
        self._held = 0  # deliveries received and not finished
        self._shared = 0  # non-suspects running
        self._alone = False  # a suspect running
        self._changed = asyncio.Event()
        self._waiting = 0  # deliveries and movers in ``_until``: a poke with none wakes no one

    async def start(self, paused: bool = False) -> None:
        """Consume (on probation), or stay paused: a pause outlives a reconnect."""
        if paused:
            self.paused = True
            return
        await self._consume(PROBATION_PREFETCH)

    async def pause(self) -> None:
        """Cancel the consumer; what has not started goes to ``hold`` as it arrives or wakes."""
        self.paused = True
        await self._stop_mover()
        tag, self.tag = self.tag, None
        self._poke()  # waiting deliveries look again, and find the lane paused
        if tag is not None and not self._stopped:
            try:
                await self.channel.basic_cancel(tag)
            except Exception as exc:  # the channel died: the session reconnects
                self._on_error(f"pausing the consumer of {self.queue!r} failed: {exc!r}")

    async def resume(self) -> None:
        """Consume again at full prefetch (a probe just succeeded: the queue is healthy)."""
        if not self.paused or self._stopped:
            return
        self.paused = False
        self.mode = self._target = "full"
        try:
            await self._consume(self.prefetch)
        except Exception as exc:
            self._on_error(f"resuming the consumer of {self.queue!r} failed: {exc!r}")

    async def idle(self) -> None:
        """Until no delivery of this lane is held."""
        await self._until(lambda: self._held == 0)

    async def _stop_mover(self) -> None:
        if self._mover is not None and not self._mover.done():
            self._mover.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._mover

    async def stop(self, cancel_timeout: float) -> None:
        """No more deliveries: cancel the consumer (what is held stays held)."""
        self._stopped = True
        await self._stop_mover()
        tag, self.tag = self.tag, None
        if tag is not None:
            with suppress(Exception):
                await self.channel.basic_cancel(tag, timeout=cancel_timeout)

    async def _consume(self, prefetch: int) -> None:
        await self.channel.basic_qos(prefetch_count=prefetch)
        ok = await self.channel.basic_consume(self.queue, self._deliver)
        self.tag = ok.consumer_tag

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
        self._target = mode
        if not self._stopped and not self.paused and (self._mover is None or self._mover.done()):
            self._mover = asyncio.create_task(self._move())

    async def _move(self) -> None:
        try:
            while self.mode != self._target and not self._stopped and not self.paused:
                target = self._target
                tag, self.tag = self.tag, None
                if tag is not None:
                    await self.channel.basic_cancel(tag)
                if target == "probation":
                    # Let every running handler finish before taking the next one alone
                    # (deliveries only settling, waiting for a copy's confirm, run no code).
                    await self._until(lambda: self._shared == 0 and not self._alone)
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

    async def _deliver(self, message: DeliveredMessage) -> None:
        """The consumer callback; aiormq runs each delivery as its own task."""
        props = message.header.properties
        suspect = is_suspect(
            props.headers, bool(getattr(message.delivery, "redelivered", False)), self.queue_type
        )
        self._held += 1
        try:
            if self.paused and self._hold is not None:
                await self._hold(message)
                return
            if suspect:
                if self.mode == "full" and self._target == "full":
                    log.info(
                        "queue=%s message_id=%s came back without a verdict: handling returned"
                        " messages one at a time",
                        self.queue,
                        props.message_id,
                        extra={"queue": self.queue, "event": "probation"},
                    )
                    self._want("probation")
                await self._until(lambda: self.paused or (not self._alone and self._shared == 0))
                if self._stopped:  # stopping: it goes back to the broker unstarted
                    return
                if self.paused and self._hold is not None:
                    await self._hold(message)
                    return
                self._alone = True
                done = [False]

                def release_alone() -> None:
                    if not done[0]:
                        done[0] = True
                        self._alone = False
                        self._poke()

                _release.set(release_alone)
                try:
                    await self._handle(message)
                finally:
                    release_alone()
                return
            if self.mode == "probation" and self._target == "probation":
                # Leave probation while this delivery is still unsettled: the probation consumer
                # then has no credit, so nothing can be on its way to it when it is cancelled.
                # Cancelled with a delivery in flight, RabbitMQ 4.x returns that delivery (4.0
                # and 4.2 count it as a return) and 3.10 keeps it on the channel, unsent, until
                # the channel closes (docs/versions.md).
                self._want("full")
                await self._until(lambda: self.mode == "full" or self._mover is None
                                  or self._mover.done())
            if self._alone or self._shared >= self.prefetch:
                # Leaving probation holds one delivery more than the prefetch for a moment;
                # it waits, so no more than ``prefetch`` handlers ever run at once.
                await self._until(
                    lambda: self.paused or (not self._alone and self._shared < self.prefetch)
                )
                if self._stopped:
                    return
                if self.paused and self._hold is not None:
                    await self._hold(message)
                    return
            self._shared += 1
            released = [False]

            def release_shared() -> None:
                if not released[0]:
                    released[0] = True
                    self._shared -= 1
                    if self._shared == 0 or self._held > self.prefetch:
                        self._poke()

            _release.set(release_shared)
            try:
                await self._handle(message)
            finally:
                release_shared()
        finally:
            self._held -= 1
            if self._held == 0:
                self._poke()
