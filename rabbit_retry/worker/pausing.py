"""A consumer's ``Pause`` carried out on one connection: the lane paused and resumed, the probe
that takes one message every ``probe_every`` seconds while paused, and what is logged and
counted about it. ``pause.Breaker`` (pure) says when; this module does it.

While paused, a watched failure sends its message back to the end of the queue as a confirmed
copy with its count unchanged (``decide.Outcome.HELD``), rather than a ``nack`` with requeue,
which 3.x and 4.0-4.2 quorum queues count as a return and which marks the message redelivered.

An ordered queue's lanes keep their consumers while paused (``Lane``'s fixed lanes): the
deliveries that have not started wait, and a probe lets the one that has waited longest on the
next lane run, in its key's turn. A watched failure then is sent back as a copy that holds its
key (the key's later messages wait behind it), so every key keeps its order through a pause.

Every replica resumes: a probe that succeeds or fails for a reason the pause does not watch
ends the pause (so does any such answer from a delivery still in flight), and so does a probe
that finds the queue empty while another consumer takes its messages (another replica that
resumed; a paused one has no consumer). An empty queue with no consumer says nothing of the
downstream: the pause holds, so the messages that tripped it, back from their tier, are not
charged again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiormq import spec
from aiormq.abc import DeliveredMessage

from rabbit_retry.worker import shutdown
from rabbit_retry.worker.decide import Outcome
from rabbit_retry.worker.lane import Lane
from rabbit_retry.worker.metrics import QueueMetrics
from rabbit_retry.worker.pause import Breaker, Change

log = logging.getLogger("rabbit_retry.worker")


def _digest(body: bytes) -> str:
    """Tells messages without a message_id apart, for a Pause's count."""
    import hashlib  # only a Pause's failures need it

    return hashlib.blake2b(body, digest_size=16).hexdigest()


class Pausing:
    """One consumer's ``Breaker`` (it outlives reconnects) at work on a session's ``lanes`` of
    ``queue``: its one lane, or an ordered queue's lanes (fixed, probed where they wait)."""

    def __init__(
        self,
        breaker: Breaker,
        queue: str,
        lanes: list[Lane],
        consumer: str,
        metrics: QueueMetrics,
        handle: Callable[[DeliveredMessage], Awaitable[None]] | None,
        lost: Callable[[str], None],
    ) -> None:
        self.breaker = breaker
        self.lanes = lanes
        self.queue = queue
        self.consumer = consumer
        self.metrics = metrics
        self._handle = handle  # runs a probe's message like any delivery (None: fixed lanes)
        self._lost = lost
        self._probe: asyncio.Task[None] | None = None
        self._handling: asyncio.Task[None] | None = None  # a probe loop handling its message
        self._why = ""
        self._next = 0  # the lane probed next (an ordered queue's)

    def heard(
        self, outcome: Outcome, error: BaseException | None, message: DeliveredMessage
    ) -> tuple[Outcome, Change]:
        """Tell the breaker how a handler call ended, as it ends (before anything awaits, so in
        the order of the failures it counts); the outcome to decide with (a watched failure
        while paused is not charged: ``HELD``) and what changed."""
        breaker = self.breaker
        if outcome is Outcome.SUCCESS:
            return outcome, breaker.succeeded()
        if outcome is Outcome.HELD:  # cut off by a stop: says nothing of the downstream
            return outcome, Change.NONE
        if outcome is Outcome.FAILED and error is not None and breaker.rule.watches(error):
            if breaker.paused:
                return Outcome.HELD, Change.NONE
            props = message.header.properties
            change = breaker.failed(props.message_id or _digest(message.body))
            if change is Change.PAUSED:
                self._why = f"{type(error).__name__}: {error}"[:300]
            return outcome, change
        return outcome, breaker.answered()

    async def carry_out(self, change: Change) -> None:
        if change is Change.PAUSED:
            await self.pause()
        elif change is Change.RESUMED:
            await self.resume("a message was handled")

    async def pause(self) -> None:
        self.breaker.since = time.monotonic()
        self.metrics.paused = 1
        self.metrics.pauses += 1
        log.warning(
            "paused queue=%s consumer=%s after %d failures in a row of different messages"
            " (last: %s); probing every %gs",
            self.queue, self.consumer, self.breaker.rule.after, self._why,
            self.breaker.rule.probe_every,
            extra={"queue": self.queue, "event": "paused", "reason": self._why},
        )
        for lane in self.lanes:
            await lane.pause()
        if not self.breaker.paused:
            # A delivery answered after this pause was decided and before it was carried out
            # (its failure's copy waited for a confirm): that resume found the lanes not paused
            # yet, and no probe would ever run. Resume now.
            await self.resume("a message was handled as the pause began")
            return
        self.start_probe()

    async def resume(self, why: str) -> None:
        self.metrics.paused = 0
        log.warning(
            "resumed queue=%s consumer=%s after %.1fs paused: %s",
            self.queue, self.consumer, time.monotonic() - self.breaker.since, why,
            extra={"queue": self.queue, "event": "resumed", "reason": why},
        )
        for lane in self.lanes:
            await lane.resume()

    def start_probe(self) -> None:
        """Probe while paused (also after a reconnect: a pause outlives its session)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probing())

    async def stop(self) -> None:
        """No more probes. One whose message is being handled finishes, within the stop's
        grace (the session waits for its task, as for any delivery's); a probe loop that only
        waits is cancelled."""
        probe, self._probe = self._probe, None
        if probe is not None and not probe.done() and self._handling is not probe:
            await shutdown.cancel([probe])

    async def _probing(self) -> None:
        """Every ``probe_every`` seconds, once nothing of the lanes runs, take one message with
        ``basic.get`` and handle it (an ordered queue: let a waiting delivery run); the breaker
        hears how it ended."""
        breaker = self.breaker
        try:
            while breaker.paused:
                await asyncio.sleep(breaker.rule.probe_every)
                for lane in self.lanes:
                    await lane.idle()
                if not breaker.paused:
                    return
                if self.lanes[0].fixed:
                    self._probe_a_lane()
                    continue
                channel = self.lanes[0].channel
                message = await channel.basic_get(self.queue, no_ack=False)
                if not isinstance(message.delivery, spec.Basic.GetOk):
                    # Nothing to ask the downstream with. If another consumer takes the queue's
                    # messages (another worker that resumed: a paused one has none), it answered.
                    declared = await channel.queue_declare(self.queue, passive=True)
                    if declared.consumer_count and breaker.answered() is Change.RESUMED:
                        await self.resume("the queue is empty and another consumer takes its"
                                          " messages")
                        return
                    continue
                log.info("queue=%s: probing with message_id=%s", self.queue,
                         message.header.properties.message_id,
                         extra={"queue": self.queue, "event": "probe"})
                assert self._handle is not None
                self._handling = asyncio.current_task()
                try:
                    await self._handle(message)
                finally:
                    self._handling = None
                if self._probe is not asyncio.current_task():
                    return  # stopped meanwhile
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel died: the session reconnects, still paused
            self._lost(f"probing {self.queue!r} failed: {exc!r}")

    def _probe_a_lane(self) -> None:
        """The next lane with a delivery waiting lets it run (none waits: nothing to ask the
        downstream with, and the pause holds)."""
        count = len(self.lanes)
        for step in range(count):
            lane = self.lanes[(self._next + step) % count]
            if (message_id := lane.probe()) is not None:
                self._next = (self._next + step + 1) % count
                log.info("queue=%s: probing with message_id=%s from %s", self.queue,
                         message_id or None, lane.queue,
                         extra={"queue": self.queue, "event": "probe"})
                return
