"""Carrying out migrations (broker/migrate_plan.py decides the steps) over AMQP, reading the
live bindings and consumers through the management API.

Moving messages: consume the source with a window of unacked messages, publish the copies
(mandatory, persistent) in batches without waiting, and ack each original only once its copy
is confirmed, a settled stretch at a time with one multiple ack. Killed in between, the
unacked originals go back to their queue and the next run recognises the copies already moved
(migrate_plan.Copies) by looking at the destination first, where that is safe (the holding
queue, which nobody else consumes; the new queue while nothing consumes it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import cast
from urllib.parse import quote

import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from rabbit_retry.broker.batch import publish_batch
from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect, rebuilding
from rabbit_retry.broker.inspect import parse_bindings
from rabbit_retry.broker.management import Management, NotFound, Refused
from rabbit_retry.broker.migrate_plan import (
    MARKER_HEADER,
    MARKER_VALUE,
    Copies,
    Migration,
    Rename,
    Step,
    hold_arguments,
    hold_queue,
    identity,
    is_marker,
    moved_headers,
    schedule,
)
from rabbit_retry.broker.requeue import REQUEUE_POLL_S, REQUEUE_WAIT_S, requeue_batches
from rabbit_retry.contract import republish_properties
from rabbit_retry.errors import BrokerError, ConflictError
from rabbit_retry.settings import Settings, mask
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Queue

TIMEOUT = 60.0
WINDOW = 1000  # messages taken (unacked) whose copies are not confirmed and acked yet
FIRST_WINDOW = 100  # the window until the size of the messages is known
BYTES_IN_FLIGHT = 64 * 1024 * 1024  # bodies held at once, about: large messages, fewer of them
ACK_EVERY = 100  # originals acked at once (one multiple ack) while more copies are in flight
PUBLISH_BATCH = 100  # copies written at once
STALL = 1.0  # seconds without a delivery before the source is counted again
RELEASE_ATTEMPTS = 20  # rounds of "close consumers, drain, delete if empty and unused"
RELEASE_WATCH = 2.0  # seconds to watch for the moment a closed consumer is gone
LISTING_WAIT = 15.0  # seconds to wait for the management API to list a consumer the broker counts
LISTING_POLL = 0.25
# Seconds a queue may still count the move's own consumer after its cancel: a quorum queue
# applies the cancel through its log, and its count lagged it under load (4.0, a CI run).
OWN_CONSUMER_GONE = 5.0

Say = Callable[[str], None]
# Told, just before a rebuilt queue starts taking its messages back (``route-back``, or
# ``refill`` when a run resumes there), the queue and how many messages it holds once refilled;
# raises to stop ``migrate`` there (provision: an eviction that was not accepted).
Refilling = Callable[[str, int], None]
# Told, once a rename has unbound the old queue and rerouted its retry exchange, just before
# its first move, the exact (ready, consumers) of every queue it moves from or into that is
# on the broker; raises to stop there (provision: an eviction that was not accepted).
Moving = Callable[[Rename, Mapping[str, tuple[int, int]]], None]


class CopyRefused(BrokerError):
    """``MigrationRun.move``: the destination refused a copy (publisher nack)."""


@dataclass
class Moved:
    moved: int = 0
    dropped: int = 0  # copies already at the destination, or routed there too
    by_source: dict[str, int] = field(default_factory=dict)  # a rename's: moved from each queue


@dataclass
class Outcome:
    name: str
    steps: list[Step] = field(default_factory=list)
    drained: Moved = field(default_factory=Moved)
    refilled: Moved = field(default_factory=Moved)
    closed: int = 0  # consumer connections closed


class MigrationRun:
    """One run of ``migrate``: its connection, the management API, and how it says each step."""

    def __init__(
        self, connection: AbstractConnection, api: Management, settings: Settings, say: Say,
        refilling: Refilling | None = None,
    ) -> None:
        self.connection = connection
        self.api = api
        self.settings = settings
        self.vhost = settings.vhost
        self.say = say
        self.refilling = refilling

    async def channel(self, *, confirms: bool = False) -> aiormq.abc.AbstractChannel:
        channel = await self.connection.channel(
            publisher_confirms=confirms, on_return_raises=confirms
        )
        return await channel.get_underlay_channel()

    def bindings_to(self, queue: str) -> list[Binding]:
        path = f"/queues/{quote(self.vhost, safe='')}/{quote(queue, safe='')}/bindings"
        try:
            raw = self.api.get(path)
        except NotFound:
            return []
        return list(parse_bindings(raw))

    async def count(self, queue: str) -> tuple[int, int] | None:
        """(ready, consumers) as the broker counts them now; None if ``queue`` is gone."""
        channel = await self.channel()
        try:
            ok = await channel.queue_declare(queue, passive=True, timeout=TIMEOUT)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        await channel.close()
        return int(ok.message_count or 0), int(ok.consumer_count or 0)

    async def rebind(self, queue: str, bindings: Sequence[Binding], *, bind: bool) -> None:
        channel = await self.channel()
        for b in bindings:
            method = channel.queue_bind if bind else channel.queue_unbind
            await method(
                queue, b.source, routing_key=b.routing_key, arguments=dict(b.arguments),
                timeout=TIMEOUT,
            )
        await channel.close()

    async def peek(self, queue: str) -> Copies:
        """The identities of every message ready in ``queue``, which keeps them all, in their
        order: they are taken unacked and given back, a classic queue's with one
        ``nack(requeue)`` (each returns to its place), a quorum queue's in order in small
        batches (broker/requeue.py)."""
        state = await self.count(queue)
        if not state or not state[0]:
            return Copies()
        quorum = (self.api.queue(self.vhost, queue) or {}).get("type") == "quorum"
        channel = await self.channel()
        seen = []
        tags = []
        for _ in range(state[0]):
            got = await channel.basic_get(queue, no_ack=False, timeout=TIMEOUT)
            if not isinstance(got.delivery, spec.Basic.GetOk):
                break
            tags.append(int(got.delivery.delivery_tag or 0))
            seen.append(identity(got.header.properties.message_id, got.body))
        if tags and not quorum:
            await channel.basic_nack(tags[-1], multiple=True, requeue=True)
        elif tags:
            await _give_back_in_order(channel, queue, tags)
        await channel.close()
        return Copies(seen)

    async def exact(self, queue: str) -> int:
        state = await self.count(queue)
        if state is None:
            raise BrokerError(f"{queue} disappeared while migrating; run migrate again")
        return state[0]

    async def move(self, source: str, target: str, copies: Copies, *, marker: bool) -> Moved:
        """Every ready message of ``source`` into ``target``, each copy confirmed before its
        original is acked; a message ``copies`` holds is dropped instead. With ``marker``, the
        messages after the marker (routed to ``target`` as well) are dropped, and the marker is
        acked last, so that a run killed meanwhile finds it again first.

        Rounds of: count what ``source`` holds ready, consume that many with a window of
        unacked messages (``FIRST_WINDOW`` in the first round, then ``window_for`` their size),
        publish their copies without waiting (the confirms come back in a pipeline), ack the
        originals whose copies are confirmed with one multiple ack per stretch. A round ends
        when it has taken what it counted; ``move`` ends when a round counts nothing. A source
        whose messages are not handed to us (another consumer wins them: a single active
        consumer, a higher priority) is taken with ``basic.get``."""
        mover = _Mover(self, await self.channel(confirms=True), source, target, copies, marker)
        try:
            await mover.run_rounds()
        except aiormq.exceptions.PublishError as exc:
            raise BrokerError(
                f"moving {source} to {target}: the broker returned a copy ({mask(str(exc))}); "
                "the original stays in place"
            ) from None
        except aiormq.exceptions.DeliveryError:
            raise CopyRefused(
                f"moving {source} to {target}: the broker refused a copy (publisher nack; is "
                f"{target!r} full?); the original stays in place"
            ) from None
        finally:
            if not mover.channel.is_closed:
                await mover.channel.close()
        return mover.done

    def consumer_connections(self, queues: Sequence[str]) -> list[str]:
        """The connections with a consumer on any of ``queues``. The queue's own consumer
        details lack the channel on some versions (3.10 gives an empty list), so the vhost's
        consumer list is read too."""
        where = quote(self.vhost, safe="")
        listed = []
        try:
            listed += self.api.get(f"/consumers/{where}")
        except NotFound:
            return []
        for queue in queues:
            try:
                raw = self.api.get(f"/queues/{where}/{quote(queue, safe='')}")
            except NotFound:
                continue
            listed += [{**c, "queue": {"name": queue}} for c in raw.get("consumer_details") or []]
        names = set()
        for consumer in listed:
            on = consumer.get("queue")
            if isinstance(on, dict) and on.get("name") not in queues:
                continue
            channel = consumer.get("channel_details")
            if isinstance(channel, dict) and channel.get("connection_name"):
                names.add(str(channel["connection_name"]))
        return sorted(names)


def window_for(average_body: float) -> int:
    """How many messages of this average size to hold unacked at once: ``WINDOW``, fewer when
    that many would hold more than ``BYTES_IN_FLIGHT`` of bodies, never fewer than one."""
    return max(1, min(WINDOW, int(BYTES_IN_FLIGHT // max(average_body, 1.0))))


@dataclass
class _Taken:
    """An original taken from the source and not acked yet."""

    tag: int
    settled: bool = False  # its copy is confirmed, or the destination holds one already


class _Mover:
    """One ``MigrationRun.move``: the originals taken, in delivery order, until each may be acked.

    The loop takes deliveries and publishes their copies in batches (one write each,
    broker/batch.py); confirms mark originals settled as they come back, and one acking task
    acks the settled stretch at the head with a single multiple ack. Once anything fails,
    nothing more is acked: what is unacked goes back to the source when the channel closes."""

    def __init__(
        self,
        run: MigrationRun,
        channel: aiormq.abc.AbstractChannel,
        source: str,
        target: str,
        copies: Copies,
        marker: bool,
    ) -> None:
        self.run = run
        self.channel = cast(aiormq.Channel, channel)  # publish_batch needs the concrete one
        self.source, self.target = source, target
        self.copies, self.marker = copies, marker
        self.done = Moved()
        self.taken: deque[_Taken] = deque()
        self.batch: list[tuple[_Taken, bytes, spec.Basic.Properties]] = []
        self.in_flight = 0  # copies published, not confirmed yet
        self.ack_to = 0  # the last settled tag, not acked yet
        self.unacked = 0  # settled originals not acked yet
        self.last_tag = 0  # the last delivery tag taken (the channel counts 1, 2, 3, ...)
        self.prefetch = FIRST_WINDOW
        # Acks this round may send before its consumer is cancelled (see ``round``), and sent.
        self.budget: float = 0
        self.acked = 0
        self.alone: list[int] = []  # originals to ack one by one once the round's consumer is gone
        self.acking = asyncio.Lock()
        self.held_marker: int | None = None
        self.failure: BaseException | None = None
        self.inbox: asyncio.Queue[DeliveredMessage | None] = asyncio.Queue()
        self.settled = asyncio.Event()  # something at the head may be ackable
        self.idle = asyncio.Event()  # nothing in flight
        self.idle.set()
        self.bodies, self.body_bytes = 0, 0  # taken so far

    async def ready(self) -> int:
        ok = await self.channel.queue_declare(self.source, passive=True, timeout=TIMEOUT)
        return int(ok.message_count or 0)

    async def run_rounds(self) -> None:
        # A first round of a few messages tells their size, and so the window for the rest.
        await self.channel.basic_qos(prefetch_count=self.prefetch, timeout=TIMEOUT)
        acker = asyncio.ensure_future(self.ack_settled())
        first = True
        try:
            while ready := await self.ready():
                if first:
                    await self.round(min(ready, FIRST_WINDOW))
                    self.prefetch = window_for(self.body_bytes / max(self.bodies, 1))
                    await self.channel.basic_qos(prefetch_count=self.prefetch, timeout=TIMEOUT)
                    first = False
                else:
                    await self.round(ready)
            if self.held_marker is not None:
                await self.channel.basic_ack(self.held_marker)
        finally:
            acker.cancel()

    async def round(self, expected: int) -> None:
        """Take ``expected`` messages by consuming (fewer if the source runs dry first), and
        wait until every one is acked.

        The broker hands the consumer at most ``prefetch`` messages beyond those acked, so
        while it consumes, the round acks no more than ``expected - prefetch``: it is never
        handed more than it takes. A message handed over beyond the count is one the round
        must still take before it cancels; one the client dropped (aiormq drops a delivery for
        a consumer it no longer has) would stay unacked with the channel and go back to the
        source only when the move ends, after the messages that followed it. A CI run on 3.10
        moved 64 of 500 parked messages last that way, when rounds acked freely; the delivery
        tags' gap check below turns any such drop into a failed move instead."""
        inbox = self.inbox = asyncio.Queue()
        self.budget, self.acked = max(0, expected - self.prefetch), 0

        async def deliver(message: DeliveredMessage) -> None:
            inbox.put_nowait(message)

        ok = await self.channel.basic_consume(self.source, deliver, timeout=TIMEOUT)
        taken, by_get = 0, False
        try:
            while taken < expected and self.failure is None:
                if inbox.empty():
                    await self.flush()
                    try:
                        message = await asyncio.wait_for(inbox.get(), STALL)
                    except TimeoutError:
                        if self.in_flight:
                            continue  # the broker is slow to confirm, not the source to deliver
                        # Ready messages not handed to us go to another consumer (a single
                        # active one, one of higher priority): take them one by one instead.
                        by_get = await self.ready() > 0
                        break
                else:
                    message = inbox.get_nowait()
                if message is not None:  # None: a copy failed
                    await self.take(message)
                    taken += 1
        finally:
            if not self.channel.is_closed:
                await self.channel.basic_cancel(str(ok.consumer_tag), timeout=TIMEOUT)
        self.budget = math.inf  # handed nothing more once the cancel is answered
        while not inbox.empty():  # delivered before the broker had the cancel
            message = inbox.get_nowait()
            if message is not None:
                await self.take(message)
        while by_get and self.failure is None:
            got = await self.channel.basic_get(self.source, no_ack=False, timeout=TIMEOUT)
            if not isinstance(got.delivery, spec.Basic.GetOk):
                break
            await self.take(got)
            await self.flush()
        await self.flush()
        await self.idle.wait()
        if self.failure is not None:
            raise self.failure
        await self.ack_head(final=True)
        for tag in self.alone:
            await self.channel.basic_ack(tag)
        self.alone.clear()

    async def take(self, message: DeliveredMessage) -> None:
        if self.failure is not None:
            return  # left unacked: it goes back to the source with the channel
        tag = int(message.delivery_tag or 0)
        if tag != self.last_tag + 1:  # the client dropped a delivery: nothing more is acked
            self.failure = BrokerError(
                f"moving {self.source} to {self.target}: a delivery was skipped (delivery tag "
                f"{tag} after {self.last_tag}); nothing after it was acked, run migrate again"
            )
            return
        self.last_tag = tag
        props = message.header.properties
        self.bodies += 1
        self.body_bytes += len(message.body)
        if self.marker and is_marker(props.headers):
            if self.held_marker is None:
                self.held_marker = tag  # acked last: outside the multiple acks
            else:  # a second marker (a run killed in route-back): one is enough
                self.alone.append(tag)
                self.done.dropped += 1
            return
        if self.held_marker is not None:
            # Routed to the target as well. Acked alone: a multiple ack would take the marker.
            self.alone.append(tag)
            self.done.dropped += 1
            return
        taken = _Taken(tag)
        self.taken.append(taken)
        # (Hashing a body only while the destination holds anything to recognise.)
        if self.copies and self.copies.take(identity(props.message_id, message.body)):
            taken.settled = True
            self.done.dropped += 1
            self.settled.set()
            return
        properties = republish_properties(
            props, moved_headers(props.headers), self.run.settings.user
        )
        self.batch.append((taken, message.body, properties))
        if len(self.batch) >= PUBLISH_BATCH:
            await self.flush()

    async def flush(self) -> None:
        """Publish the copies taken so far, in one write."""
        if not self.batch or self.failure is not None:
            return
        batch, self.batch = self.batch, []
        futures = await publish_batch(
            self.channel, self.target, [(body, props) for _, body, props in batch]
        )
        self.in_flight += len(batch)
        self.idle.clear()
        for (taken, _, _), future in zip(batch, futures, strict=True):
            future.add_done_callback(partial(self.confirmed, taken))

    def confirmed(self, taken: _Taken, future: asyncio.Future[object]) -> None:
        self.in_flight -= 1
        if future.cancelled():
            self.failure = self.failure or BrokerError(
                f"moving {self.source} to {self.target}: the channel closed before the broker "
                "confirmed a copy; the original stays in place"
            )
        elif future.exception() is not None:
            self.failure = self.failure or future.exception()
        else:
            taken.settled = True
            self.done.moved += 1
        if self.failure is not None:
            self.inbox.put_nowait(None)  # wake the loop
        self.settled.set()
        if not self.in_flight:
            self.idle.set()

    async def ack_settled(self) -> None:
        while True:
            await self.settled.wait()
            self.settled.clear()
            await self.ack_head()

    async def ack_head(self, *, final: bool = False) -> None:
        """Ack, with one multiple ack, the originals up to the first one not settled yet:
        every ``ACK_EVERY`` of them, or when nothing is in flight; while the round consumes,
        within its budget. Nothing after a failure."""
        async with self.acking:  # multiple acks leave in tag order
            while self.taken and self.taken[0].settled:
                if not final and self.acked + self.unacked >= self.budget:
                    break
                self.ack_to = self.taken.popleft().tag
                self.unacked += 1
            if self.failure is not None or not self.unacked:
                return
            if final or not self.in_flight or self.unacked >= ACK_EVERY:
                await self.channel.basic_ack(self.ack_to, multiple=True)
                self.acked += self.unacked
                self.unacked = 0


async def _run_steps(
    run: MigrationRun, migration: Migration, steps: Sequence[Step], outcome: Outcome
) -> None:
    name, hold = migration.name, hold_queue(migration.name)
    queue = migration.queue
    counted_at = next((s for s in steps if s in ("route-back", "refill")), None)
    for step in steps:
        outcome.steps.append(step)
        if step == counted_at and run.refilling is not None:
            run.refilling(name, await _to_refill(run, name, hold, marked=step == "refill"))
        if step == "hold":
            channel = await run.channel()
            await channel.queue_declare(
                hold, durable=True, arguments=hold_arguments(), timeout=TIMEOUT
            )
            await channel.close()
        elif step == "route-to-hold":
            bindings = run.bindings_to(name)
            await run.rebind(hold, bindings, bind=True)
            await run.rebind(name, bindings, bind=False)
        elif step == "drain":
            await _drain(run, name, hold, outcome)
        elif step == "release":
            await _release(run, migration.queue, hold, outcome)
        elif step == "redeclare":
            channel = await run.channel()
            await channel.queue_declare(
                name, durable=queue.durable, arguments=dict(queue.arguments), timeout=TIMEOUT
            )
            await channel.close()
            run.say(f"{name}: declared again as a {queue.queue_type} queue")
        elif step == "route-back":
            held = run.bindings_to(hold)
            wanted = {b.key: b for b in [*held, *migration.bindings]}
            await run.rebind(name, list(wanted.values()), bind=True)
            if held:
                await _mark(run, hold)
                await run.rebind(hold, held, bind=False)
        elif step == "refill":
            await _refill(run, name, hold, outcome)


async def _drain(run: MigrationRun, name: str, hold: str, outcome: Outcome) -> None:
    """The ``drain`` step: move what ``name`` holds into its holding queue ``hold`` (the copies
    a stopped run left there recognised), then check that every confirmed copy is there."""
    copies = await run.peek(hold)
    before = await run.exact(hold)
    outcome.drained = await run.move(name, hold, copies, marker=False)
    # Nothing but us takes from the holding queue: every confirmed copy must be there.
    if await run.exact(hold) < before + outcome.drained.moved:
        raise BrokerError(
            f"{hold} holds fewer messages than were moved into it; the originals of "
            f"unconfirmed copies are still in {name}; run migrate again"
        )
    run.say(
        f"{name}: moved {outcome.drained.moved} messages into {hold}"
        + (f" ({outcome.drained.dropped} already there)" if outcome.drained.dropped else "")
    )


async def _refill(run: MigrationRun, name: str, hold: str, outcome: Outcome) -> None:
    """The ``refill`` step: move everything ``hold`` keeps back into the rebuilt queue
    ``name`` up to ``route-back``'s marker, check that the counts agree, and delete ``hold``."""
    state = await run.count(name)
    # What the new queue holds already: messages routed to it and to the holding queue
    # in the instant before the marker, and copies a killed run moved but never acked.
    # Not while workers consume it: then such a message may arrive twice
    # (docs/migrations.md).
    copies = await run.peek(name) if state is not None and state[1] == 0 else Copies()
    holding = await run.exact(hold)
    outcome.refilled = await run.move(hold, name, copies, marker=True)
    # Unbound, the holding queue only loses messages, and only to us: each one it held
    # was moved, or dropped as a copy, or was the marker.
    left = await run.exact(hold)
    if left or outcome.refilled.moved + outcome.refilled.dropped > holding:
        raise BrokerError(
            f"{hold}: {holding} held, {outcome.refilled.moved} moved, "
            f"{outcome.refilled.dropped} dropped, {left} left: the counts disagree; "
            "nothing was acked unconfirmed; run migrate again"
        )
    await _delete_when_empty(run, hold)
    run.say(
        f"{name}: moved {outcome.refilled.moved} messages back from {hold}"
        + (f", dropped {outcome.refilled.dropped} copies" if outcome.refilled.dropped
           else "")
        + f"; {hold} deleted"
    )


async def _to_refill(run: MigrationRun, name: str, hold: str, *, marked: bool) -> int:
    """How many messages ``name`` holds once refilled, counted exactly now: what it holds and
    what waits in ``hold`` (before ``route-back``: everything that arrived while it was rebuilt
    too). ``marked``: counted at the refill of a resumed run, after ``route-back`` put its marker
    into ``hold``, which is not counted (a queue without bindings gets no marker: then one
    fewer; a message routed to both in the instant between route-back's bind and unbind is
    counted twice)."""
    there = await run.count(name)
    held = await run.exact(hold)
    return (there[0] if there else 0) + max(0, held - marked)


async def _give_back_in_order(
    channel: aiormq.abc.AbstractChannel, queue: str, tags: Sequence[int]
) -> None:
    """Requeue ``tags`` to quorum ``queue`` a batch at a time, each once the queue shows the
    previous one back; if one never shows (a consumer took them), the rest go back when the
    channel closes, in the broker's order."""
    ok = await channel.queue_declare(queue, passive=True, timeout=TIMEOUT)
    base, returned = int(ok.message_count or 0), 0
    loop = asyncio.get_running_loop()
    for batch in requeue_batches(tags):
        for tag in batch:
            await channel.basic_nack(tag, requeue=True)
        returned += len(batch)
        deadline = loop.time() + REQUEUE_WAIT_S
        while True:
            ok = await channel.queue_declare(queue, passive=True, timeout=TIMEOUT)
            if int(ok.message_count or 0) >= base + returned:
                break
            if loop.time() > deadline:
                return
            await asyncio.sleep(REQUEUE_POLL_S)


async def _mark(run: MigrationRun, hold: str) -> None:
    channel = await run.channel(confirms=True)
    await channel.basic_publish(
        b"", exchange="", routing_key=hold, mandatory=True, timeout=TIMEOUT,
        properties=spec.Basic.Properties(
            headers={MARKER_HEADER: MARKER_VALUE}, delivery_mode=2, app_id="rabbit-retry"
        ),
    )
    await channel.close()


async def _release(run: MigrationRun, queue: Queue, hold: str, outcome: Outcome) -> None:
    """Delete ``queue`` once nothing consumes it and it is empty, draining what consumers gave
    back.

    A worker whose connection is closed reconnects by itself, after the wait the close's reason
    asks for when migrate closed it (a second, twice as long each round); so right after
    closing, ``queue`` is watched on one channel and deleted in the first moment it has neither
    consumers nor messages, one round trip later. A worker back before that only means another
    round, with a longer wait.

    A parking queue is published to by its main queue's workers, through the default exchange,
    which has no binding to move; and RabbitMQ confirms a publish on its way to a queue
    deleted under it, as if delivered. So the connections of those workers are closed too,
    and the parking queue is deleted only while none of them consumes: a park still on its
    way then has nobody to ack its original, which the broker gives back.
    """
    name = queue.name
    publishers = _publishers(run, queue)
    classic = (run.api.queue(run.vhost, name) or {}).get("type", "classic") == "classic"
    for attempt in range(RELEASE_ATTEMPTS):
        for connection in await _listed(run, [name, *publishers]):
            try:
                run.api.close_connection(connection, rebuilding(name, attempt))
            except Refused:
                raise BrokerError(
                    f"{name}: cannot close its consumer connection {connection!r}: user "
                    f"{run.api.user!r} may close only its own connections (an administrator "
                    f"may close any); its messages are safe in {hold}; stop that consumer and "
                    "run migrate again"
                ) from None
            run.say(f"{name}: closed consumer connection {connection!r}; it reconnects by itself")
            outcome.closed += 1
        more = await run.move(name, hold, Copies(), marker=False)
        outcome.drained.moved += more.moved
        channel = await run.channel()
        watch_until = time.monotonic() + RELEASE_WATCH
        try:
            while True:
                try:
                    ok = await channel.queue_declare(name, passive=True, timeout=TIMEOUT)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    return
                if ok.message_count:
                    break  # drain again
                if not ok.consumer_count and not await _consumed(run, publishers):
                    if _held_unacked(run, name):
                        # Taken with basic.get and not settled yet: drain them once back.
                        await asyncio.sleep(RELEASE_WATCH)
                        break
                    # A classic queue checks both at once; a quorum queue cannot
                    # (NOT_IMPLEMENTED), so it relies on the exact count just read.
                    await channel.queue_delete(
                        name, if_unused=classic, if_empty=classic, timeout=TIMEOUT
                    )
                    return
                if time.monotonic() > watch_until:
                    break
                await asyncio.sleep(0.002)
        except aiormq.exceptions.ChannelPreconditionFailed:
            continue
        finally:
            if not channel.is_closed:
                await channel.close()
    raise BrokerError(
        f"{name} kept getting consumers or messages through {RELEASE_ATTEMPTS} attempts to "
        f"delete it; its messages are safe in {hold}; stop its consumers and run migrate again"
    )


def _held_unacked(run: MigrationRun, name: str) -> bool:
    """Whether a client holds messages of ``name`` unacked without consuming it (``basic.get``:
    ``parking show``, a paused worker's probe). Neither the exact counts nor ``if-empty`` see
    them, and deleting the queue would lose them when they are given back. The management
    statistics do, a few seconds late."""
    stats = run.api.queue(run.vhost, name) or {}
    return int(stats.get("messages_unacknowledged") or 0) > 0


def _publishers(run: MigrationRun, queue: Queue) -> list[str]:
    """The queues whose consumers publish to ``queue`` straight (not through a binding
    ``migrate`` can move): for a parking queue, its main queue and the main queue's lanes and
    held queues, as the broker has them."""
    if queue.role != "parking":
        return []
    lanes = naming.lane_queue(queue.owner, 0)[:-1]
    live = [str(q.get("name", "")) for q in run.api.queues(run.vhost)]
    return [queue.owner, *sorted(n for n in live if n.startswith(lanes))]


async def _listed(run: MigrationRun, queues: Sequence[str]) -> list[str]:
    """The connections consuming ``queues``, once the management API lists them. Its list comes
    from statistics (every ``collect_statistics_interval``, 5 s by default) and lags a consumer
    that came a moment ago: while the broker's exact counts say ``queues`` are consumed and the
    list names nobody, wait for it (up to LISTING_WAIT seconds). Without the wait, a worker
    that had just reconnected went on parking unnamed, and migrate spent its 20 rounds in a few
    seconds (a loaded machine, 4.0)."""
    deadline = time.monotonic() + LISTING_WAIT
    while True:
        listed = run.consumer_connections(queues)
        if listed or time.monotonic() > deadline or not await _consumed(run, queues):
            return listed
        await asyncio.sleep(LISTING_POLL)


async def _consumed(run: MigrationRun, queues: Sequence[str]) -> bool:
    """Whether any of ``queues`` has a consumer, as the broker counts it now (a queue that is
    not there has none)."""
    for queue in queues:
        state = await run.count(queue)
        if state is not None and state[1]:
            return True
    return False


async def _delete_when_empty(run: MigrationRun, queue: str, *, checked: bool = True,
                             refused: str = "is not empty after moving its messages back; run "
                             "migrate again") -> None:
    """Delete ``queue``; with ``checked`` only while the broker finds it empty and unused (a
    classic queue checks both as it deletes; a quorum queue cannot). ``refused``: what to say
    when the broker refuses."""
    channel = await run.channel()
    try:
        await channel.queue_delete(queue, if_unused=checked, if_empty=checked, timeout=TIMEOUT)
    except aiormq.exceptions.ChannelPreconditionFailed:
        raise BrokerError(f"{queue} {refused}") from None
    finally:
        if not channel.is_closed:
            await channel.close()


async def migrate(
    settings: Settings, migrations: Sequence[Migration], say: Say = lambda _: None,
    refilling: Refilling | None = None,
) -> list[Outcome]:
    """Run every migration's remaining steps, in ``schedule``'s order; ``refilling`` is told
    what each rebuilt queue will hold before it takes its messages back."""
    outcomes: dict[str, Outcome] = {}
    async with migration_run(settings, say, refilling) as run:
        for migration, steps in schedule(migrations):
            outcome = outcomes.setdefault(migration.name, Outcome(migration.name))
            with finish_later(f"migrating {migration.name}", outcome.steps):
                await _run_steps(run, migration, steps, outcome)
    return [outcomes[m.name] for m in migrations]


@asynccontextmanager
async def migration_run(settings: Settings, say: Say, refilling: Refilling | None = None
                        ) -> AsyncIterator[MigrationRun]:
    """One connection and one management client for a whole ``migrate``."""
    connection = await connect(settings, name="rabbit-retry migrate")
    try:
        with Management.for_settings(settings) as api:
            yield MigrationRun(connection, api, settings, say, refilling)
    finally:
        await connection.close()


@contextmanager
def finish_later(what: str, steps: Sequence[str] = ()) -> Iterator[None]:
    """A connection lost in the block: one line saying what stopped (at the last of ``steps``
    begun, if any) and that running migrate again finishes the work."""
    try:
        yield
    except CONNECTION_ERRORS as exc:
        if isinstance(exc, BrokerError):
            raise
        at = f" at {steps[-1]}" if steps else ""
        raise BrokerError(f"{what} stopped{at}: {mask(str(exc)) or type(exc).__name__}; "
                          "nothing is lost, run migrate again to finish") from exc


# --- renames (``renamed_from``) ------------------------------------------------------------


async def _run_rename(run: MigrationRun, rename: Rename, moving: Moving | None = None) -> Moved:
    """Unbind the old queue from every exchange, route its retry exchange to where its queues
    are moved (``_redirect_dead_letters``), move each of its queues' messages where
    ``rename.moves`` says (``MigrationRun.move``: each copy confirmed before its original is acked),
    delete each queue once emptied, then its exchanges and policy. Run again after a stop at
    any point, it finds what is left: the bindings are read again, the queues already deleted
    are skipped, and a copy already in a destination nothing consumes is not moved twice.
    ``moving`` is told the exact counts once nothing new reaches ``old``'s queues, before the
    first move: what the moves evict is counted there."""
    total = Moved()
    await _refuse_while_consumed(run, rename)
    await _targets_there(run, rename)
    await _unbind_old(run, rename)
    await _redirect_dead_letters(run, rename)
    if moving is not None:
        moving(rename, await _counts_now(run, [q for pair in rename.moves for q in pair]))
    for source, target in rename.moves:
        moved = await _move_queue(run, rename, source, target)
        if moved is None:
            continue  # moved and deleted by an earlier run
        total.moved += moved.moved
        total.dropped += moved.dropped
        total.by_source[source] = moved.moved
    await _delete_old_objects(run, rename)
    return total


async def _refuse_while_consumed(run: MigrationRun, rename: Rename) -> None:
    """Stop while a worker still consumes a queue of ``old``: the messages it holds unacked
    would go back there after the move. Nothing more is moved."""
    for source, _ in rename.moves:
        state = await run.count(source)
        if state is not None and state[1]:
            raise BrokerError(
                f"{source} has {plural(state[1], 'consumer')}: stop the workers still "
                f"consuming the old name (their unacked messages go back to {source}), then "
                "run migrate again; nothing more was moved"
            )


async def _unbind_old(run: MigrationRun, rename: Rename) -> None:
    """Unbind ``old`` and its holding queue from every exchange that routes to them but their
    own retry and lanes exchanges, so that nothing new reaches them (it reaches the new queue,
    bound already by ``apply``)."""
    own = {naming.retry_exchange(rename.old), naming.lanes_exchange(rename.old)}
    for source in (rename.old, naming.migrating_queue(rename.old)):
        # The default exchange's implicit binding cannot be removed; the old queue's own retry
        # exchange still brings back what its tiers hold until they are moved.
        feeding = [b for b in run.bindings_to(source) if b.source and b.source not in own]
        await run.rebind(source, feeding, bind=False)
        if feeding:
            run.say(f"{source}: unbound from {', '.join(sorted({b.source for b in feeding}))}")


async def _counts_now(run: MigrationRun, queues: Sequence[str]) -> dict[str, tuple[int, int]]:
    """queue -> (ready, consumers) as the broker counts them now, for each of ``queues`` (once
    each) that is on the broker."""
    counts: dict[str, tuple[int, int]] = {}
    for queue in dict.fromkeys(queues):
        if (state := await run.count(queue)) is not None:
            counts[queue] = state
    return counts


async def _move_queue(run: MigrationRun, rename: Rename, source: str, target: str
                      ) -> Moved | None:
    """Move the messages of ``source``, a queue of ``old``, into ``target``, then delete it;
    None when an earlier run did both."""
    if await run.count(source) is None:
        return None
    there = await run.count(target)
    if there is None:
        raise BrokerError(
            f"{target} is not on the broker; run apply first: the messages of {source} "
            "stay where they are"
        )
    # What the destination holds already, when nothing consumes it: copies a stopped run
    # confirmed but never acked the originals of. Not while workers consume it: then such
    # a message may arrive twice (docs/migrations.md).
    copies = await run.peek(target) if there[1] == 0 else Copies()
    try:
        moved = await run.move(source, target, copies, marker=False)
    except CopyRefused:
        raise await _move_refused(run, rename, source, target) from None
    await _delete_emptied(run, source)
    run.say(
        f"{source}: moved {plural(moved.moved, 'message')} into {target}"
        + (f" ({moved.dropped} already there)" if moved.dropped else "")
        + f"; {source} deleted"
    )
    return moved


async def _delete_old_objects(run: MigrationRun, rename: Rename) -> None:
    """Delete ``old``'s exchanges, then its policy: last, once its queues are gone."""
    channel = await run.channel()
    for exchange in rename.exchanges:
        await channel.exchange_delete(exchange, timeout=TIMEOUT)
        run.say(f"exchange {exchange} deleted")
    await channel.close()
    if rename.policy:
        path = f"/policies/{quote(run.vhost, safe='')}/{quote(rename.policy, safe='')}"
        response = run.api.request("DELETE", path)
        if response.status_code >= 400 and response.status_code != 404:
            raise BrokerError(
                f"deleting policy {rename.policy}: the broker answered {response.status_code}; "
                "its queues are gone already, run migrate again"
            )
        run.say(f"policy {rename.policy} deleted")


async def _move_refused(run: MigrationRun, rename: Rename, source: str,
                        target: str) -> BrokerError:
    """The one line for a move ``target`` refused (publisher nack: a quorum queue over its
    length limit refuses, ``on_full: reject``): the originals of what was not confirmed stay in
    ``source``, which nothing new reaches; the copies confirmed after the refusal are in both,
    recognised at the next run while nothing consumes ``target``. How many stay is not said:
    the move's unacked originals go back to a quorum ``source`` some time after its channel
    closed (RabbitMQ 4.0.5 counted 0 ready where 200 stayed)."""
    there = await run.count(target)
    return BrokerError(
        f"renaming {rename.old} to {rename.new}: {target} refused a copy (publisher nack: full, "
        f"on_full: reject) at {plural(there[0] if there else 0, 'message')}; the originals of "
        f"the copies it did not take stay in {source}, nothing is lost; let {target}'s "
        "consumers make room or raise its limit, then run migrate again"
    )


async def _targets_there(run: MigrationRun, rename: Rename) -> None:
    """Refuse, before anything is changed, while a queue that a queue of ``old`` still on the
    broker moves into is missing (deleted by hand after ``migrate`` read the broker). Without
    this, the redirect's bind to it (``NEW.parking``, say) failed with the broker's 404 after
    ``old`` was unbound already. ``migrate`` does not declare it: its definition (type,
    arguments, policy) is ``apply``'s, as it is when ``migrate`` finds it missing before it
    starts (the same refusal, exit 3) or when a move finds its destination gone."""
    for source, target in rename.moves:
        if await run.count(source) is not None and await run.count(target) is None:
            raise ConflictError(
                f"queue {rename.old} -> {rename.new}: {target} is not on the broker (deleted "
                f"after migrate read it?); run apply with the file first, which declares it, "
                "then migrate again; nothing was changed"
            )


async def _redirect_dead_letters(run: MigrationRun, rename: Rename) -> None:
    """Bind ``old``'s retry exchange to where each of its queues is moved, then unbind it from
    them, before anything is moved or deleted. What ``old`` dead-letters (a message that expires
    or overflows in it, or passes a quorum queue's delivery limit) goes through that exchange
    to its first tier or its parking queue, which are moved and deleted before ``old``; and
    ``old`` cannot go first, its tiers expire into it through the default exchange, which no
    binding can redirect. Without this, a message ``old`` dead-lettered once its first tier was
    deleted had no route and the broker dropped it; now it goes where the move would take it
    (``NEW``, ``NEW.parking``), and ``old``'s queues get nothing more from the exchange. Bound
    before unbound: a message dead-lettered in between reaches both, a copy rather than a loss.
    A run stopped after this finds no such binding left and skips it; the bindings go with the
    exchange, deleted last."""
    retry = naming.retry_exchange(rename.old)
    for source, target in rename.moves:
        routes = [b for b in run.bindings_to(source) if b.source == retry]
        if not routes:
            continue
        try:
            await run.rebind(target, routes, bind=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            # Deleted in the moment since _targets_there looked: unbind nothing more.
            raise BrokerError(
                f"{retry}: cannot route to {target}: it is not on the broker (deleted while "
                f"migrate ran?); {source} keeps its messages and still gets what "
                f"{rename.old} dead-letters; run apply with the file, then migrate again"
            ) from None
        await run.rebind(source, routes, bind=False)
        run.say(f"{retry}: routes to {target} in place of {source}")


async def _delete_emptied(run: MigrationRun, queue: str) -> None:
    """Delete ``queue`` now that its messages are moved: only while it is empty and unused (a
    classic queue checks both as it deletes; a quorum queue cannot, so the exact count just
    read decides)."""
    classic = (run.api.queue(run.vhost, queue) or {}).get("type", "classic") == "classic"
    state = await run.count(queue)
    deadline = time.monotonic() + OWN_CONSUMER_GONE
    while state is not None and state[0] == 0 and state[1] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        state = await run.count(queue)
    if state is None:
        return
    after = "while its messages were moved; nothing is lost, run migrate again"
    if state != (0, 0):
        got = plural(state[0], "message") if state[0] else plural(state[1], "consumer")
        raise BrokerError(f"{queue} got {got} {after}")
    await _delete_when_empty(run, queue, checked=classic,
                             refused=f"got messages or a consumer {after}")


async def rename(
    settings: Settings, renames: Sequence[Rename], say: Say = lambda _: None,
    moving: Moving | None = None,
) -> list[Moved]:
    """Carry out every rename (``_run_rename``), in order; ``moving`` is told the counts of
    each just before its first move."""
    out = []
    async with migration_run(settings, say) as run:
        for one in renames:
            with finish_later(f"renaming {one.old} to {one.new}"):
                out.append(await _run_rename(run, one, moving))
    return out
