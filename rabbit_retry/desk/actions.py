"""An operator's actions on stored messages: replay (publish back, confirmed) and discard.

A replay first takes its rows and writes its audit entry in one transaction (from then on no
other action takes them), then claims them a page at a time (``parked -> replaying``) while it
publishes the page before, each row's copy with ``mandatory`` and publisher confirms, many in
flight at once, and marks rows ``replayed`` only once the broker confirmed them. A copy the
broker returns (no such queue) or refuses (``nack``: the queue is full) puts its row back to
``parked``, and the audit entry says why. The replay holds a lease in the store that it renews
while it runs; when its desk dies, another desk (or the same one restarted) takes the lease once
it has run out and publishes what was not yet marked replayed. Nothing is lost; a copy confirmed
just before the kill and not yet marked is published once more (each copy carries the replay's
id in ``replay-id`` and its original ``message_id``, so a consumer can tell).

Replayed copies get the CLI's replay properties (``parking.headers.replay_properties``): parking
and death headers stripped, ``retry-count`` reset, ``replay-count`` + 1, a per-message TTL back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiormq
import aiormq.exceptions
from aiormq.abc import AbstractConnection
from pamqp import commands as spec

from rabbit_retry import contract, tracing
from rabbit_retry.broker.batch import publish_batch
from rabbit_retry.broker.connect import connect
from rabbit_retry.desk.records import stored_body, stored_properties
from rabbit_retry.desk.store import Claimed, Selection, Store
from rabbit_retry.errors import InputError
from rabbit_retry.parking.headers import replay_properties
from rabbit_retry.settings import Settings

if TYPE_CHECKING:
    from rabbit_retry.tracing.replay import ReplayTrace

log = logging.getLogger("rabbit_retry.desk")

REPLAY_ID = "replay-id"  # header on every replayed copy: the audit entry's replay id
WINDOW = 512  # copies awaiting their confirm at once
PAGE = 2000  # rows claimed and read from the store at a time
FIRST_PAGE = WINDOW  # the first page is claimed before anything is published: a small one
LEASE_S = 30.0
CONFIRM_TIMEOUT_S = 60.0


@dataclass
class ReplayResult:
    replay_id: str
    claimed: int
    replayed: int = 0
    refused: int = 0
    done: bool = False
    outcome: str | None = None


class Actions:
    """Replays and discards for one desk; ``queues`` are the topology's main queues."""

    def __init__(self, store: Store, settings: Settings, queues: set[str],
                 owner: str | None = None, lease: float = LEASE_S) -> None:
        self.store = store
        self.settings = settings
        self.queues = queues
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease = lease
        self._connection: Any = None
        self._amqp: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self.running: dict[str, asyncio.Task[ReplayResult]] = {}
        self.on_done: Callable[[str, int], None] | None = None  # (action, count): metrics

    def check_queue(self, to: str | None) -> None:
        if to is not None and to not in self.queues:
            known = ", ".join(sorted(self.queues))
            raise InputError(f'"to": {to!r} is not a queue of the topology (one of: {known})')

    async def discard(self, selection: Selection, actor: str, reason: str) -> int:
        if not reason.strip():
            raise InputError('"reason": a discard needs a reason')
        count = await asyncio.to_thread(self.store.discard, selection, actor, reason.strip())
        if self.on_done is not None:
            self.on_done("discard", count)
        return count

    async def replay(self, selection: Selection, actor: str, *, to: str | None = None,
                     rate: float | None = None) -> asyncio.Task[ReplayResult]:
        """Claim the selection and start publishing it; the task ends when every copy is
        confirmed (or refused)."""
        self.check_queue(to)
        if rate is not None and not rate > 0:
            raise InputError('"rate": messages per second must be a number above 0')
        replay_id, claimed = await asyncio.to_thread(
            self.store.start_replay, selection, actor, self.owner, to_queue=to, rate=rate,
            lease=self.lease,
        )
        return self._run(Claimed(replay_id, to, rate), claimed, actor)

    def _run(self, claimed: Claimed, count: int,
             actor: str | None = None) -> asyncio.Task[ReplayResult]:
        task = asyncio.create_task(self._publish_all(claimed, count, actor))
        self.running[claimed.id] = task
        task.add_done_callback(lambda _t: self.running.pop(claimed.id, None))
        return task

    async def adopt_abandoned(self) -> int:
        """Take over every replay whose desk stopped renewing its lease; returns how many."""
        taken = 0
        while (claimed := await asyncio.to_thread(self.store.take_abandoned, self.owner,
                                                  self.lease)) is not None:
            log.info("desk: finishing replay %s, left unfinished by a desk that stopped",
                     claimed.id)
            self._run(claimed, -1)
            taken += 1
        return taken

    async def close(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        if self._connection is not None:
            with suppress(Exception):
                await self._connection.close()
            self._connection = self._amqp = None

    async def connect(self) -> None:
        """Open the broker connection now instead of at the first replay (it is kept)."""
        channel = await self._channel()
        await channel.close()

    async def _channel(self) -> aiormq.Channel:
        async with self._lock:
            if self._amqp is None or self._amqp.is_closed:
                self._connection = await connect(self.settings, name="rabbit-retry desk replay")
                transport = self._connection.transport
                assert transport is not None
                self._amqp = transport.connection
            channel = await self._amqp.channel(publisher_confirms=True)
            assert isinstance(channel, aiormq.Channel)  # its publish takes ``wait``
            return channel

    async def _publish_all(self, claimed: Claimed, count: int,
                           actor: str | None = None) -> ReplayResult:
        """The replay's span (where the desk traces) is current for all of it; every copy
        carries it (``rabbit_retry.tracing``). A replay taken over from another desk says so
        and names no actor: the audit entry has it."""
        with tracing.replay_span("desk replay", {
            "rabbit_retry.actor": actor, "rabbit_retry.replay.id": claimed.id,
            "rabbit_retry.replay.resumed": count < 0,
            "rabbit_retry.replay.to": claimed.to_queue,
        }) as trace:
            return await self._publish_traced(claimed, count, trace)

    async def _publish_traced(self, claimed: Claimed, count: int,
                              trace: ReplayTrace | None) -> ReplayResult:
        result = ReplayResult(claimed.id, count)
        renew = asyncio.create_task(self._keep_lease(claimed.id))
        channel = await self._channel()
        try:
            outcome = await self._publish_rows(channel, claimed, result, renew, trace)
            result.outcome = outcome
            result.replayed = await asyncio.to_thread(self.store.finish_replay, claimed.id,
                                                      outcome)
            if trace is not None:
                trace.replayed(result.replayed)
            result.done = True
            if self.on_done is not None:
                self.on_done("replay", result.replayed)
            log.info("desk: replay %s done: %d replayed%s", claimed.id, result.replayed,
                     f"; {outcome}" if outcome else "")
            return result
        finally:
            renew.cancel()
            with suppress(Exception):
                await channel.close()

    async def _keep_lease(self, replay_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            if not await asyncio.to_thread(self.store.renew, replay_id, self.owner, self.lease):
                raise RuntimeError(f"replay {replay_id}: lease lost to another desk")

    async def _publish_rows(self, channel: aiormq.Channel, claimed: Claimed,
                            result: ReplayResult, renew: asyncio.Task[None],
                            trace: ReplayTrace | None = None) -> str | None:
        """Publish every row still claimed by the replay: the next page is read (and its copies
        built) while this one is published, copies go out in batches (one socket write each,
        ``broker.batch``), and confirmed rows are marked in the background, so the broker
        always has up to ``WINDOW`` copies to confirm."""
        user = self.settings.user
        # aiormq matches a basic.return to its publish by message id: never two copies with one
        # id in flight on the channel. Message id -> its confirm; these are all in flight.
        in_flight: dict[str, asyncio.Future[object]] = {}
        settled = asyncio.Event()  # a confirm (or return, nack, failure) arrived
        failure: list[BaseException] = []
        confirmed: list[int] = []
        refused: dict[int, str] = {}
        marking: asyncio.Task[None] | None = None
        started = last_confirm = time.monotonic()
        sent = 0

        def page(after: int, size: int = PAGE) -> list[Copy]:
            return [_copy(row, claimed, user, trace) for row in
                    self.store.replay_rows(claimed.id, after, size)]

        def done(copy: Copy) -> Callable[[asyncio.Future[object]], None]:
            def settle(future: asyncio.Future[object]) -> None:
                nonlocal last_confirm
                last_confirm = time.monotonic()
                if in_flight.get(copy.message_id) is future:
                    del in_flight[copy.message_id]
                settled.set()
                error = None if future.cancelled() else future.exception()
                if future.cancelled():
                    failure.append(asyncio.CancelledError())
                elif error is None:
                    confirmed.append(copy.row_id)
                elif isinstance(error, aiormq.exceptions.PublishError):
                    refused[copy.row_id] = (f"queue {copy.target!r} does not exist (the "
                                            "broker returned it)")
                elif isinstance(error, aiormq.exceptions.DeliveryError):
                    refused[copy.row_id] = f"queue {copy.target!r} refused it (full?)"
                else:
                    failure.append(error)  # the channel closed: the replay stops here

            return settle

        async def until_settled(ready: Callable[[], bool]) -> None:
            while not ready():
                if failure:
                    raise failure[0]
                settled.clear()
                await settled.wait()
            if failure:
                raise failure[0]

        def batch(copies: list[Copy], at: int) -> list[Copy]:
            """The next copies to send at once: the window's room (and the rate's), one
            target, no message id twice or already in flight (the first copy's was awaited)."""
            room = WINDOW - len(in_flight)
            if claimed.rate:
                room = min(room, max(1, int((time.monotonic() - started) * claimed.rate) - sent))
            taken: list[Copy] = []
            ids: set[str] = set()
            for copy in copies[at:at + room]:
                if taken and (copy.message_id in ids or copy.message_id in in_flight
                              or copy.target != taken[0].target):
                    break
                ids.add(copy.message_id)
                taken.append(copy)
            return taken

        async def watch() -> None:
            """One deadline for every copy instead of a timer each: no confirm (or return) for
            ``CONFIRM_TIMEOUT_S`` while copies are in flight closes the channel, which fails
            them; the replay stops and resumes when its lease runs out."""
            while True:
                await asyncio.sleep(CONFIRM_TIMEOUT_S / 6)
                if in_flight and time.monotonic() - last_confirm > CONFIRM_TIMEOUT_S:
                    log.error("desk: replay %s: no publisher confirm for %gs; stopping it",
                              claimed.id, CONFIRM_TIMEOUT_S)
                    await channel.close(TimeoutError(
                        f"no publisher confirm within {CONFIRM_TIMEOUT_S:g}s"))
                    return

        async def mark(before: asyncio.Task[None] | None, ids: list[int]) -> None:
            if before is not None:
                await before
            await asyncio.to_thread(self.store.settle_replayed, claimed.id, ids)
            result.replayed += len(ids)

        def flush() -> None:
            nonlocal marking
            if confirmed:
                ids, confirmed[:] = list(confirmed), []
                marking = asyncio.create_task(mark(marking, ids))

        watchdog = asyncio.create_task(watch())
        try:
            copies = await asyncio.to_thread(page, 0, FIRST_PAGE)
            while copies:
                following = asyncio.create_task(asyncio.to_thread(page, copies[-1].row_id))
                try:
                    at = 0
                    while at < len(copies):
                        if renew.done():
                            renew.result()  # the lease was lost: stop, the new owner goes on
                        if claimed.rate:
                            ahead = started + sent / claimed.rate - time.monotonic()
                            if ahead > 0:
                                await asyncio.sleep(ahead)
                        await until_settled(lambda: len(in_flight) < WINDOW)
                        earlier = in_flight.get(copies[at].message_id)
                        if earlier is not None:
                            await until_settled(earlier.done)
                        taken = batch(copies, at)
                        futures = await publish_batch(
                            channel, taken[0].target,
                            [(copy.body, copy.properties) for copy in taken])
                        for copy, future in zip(taken, futures, strict=True):
                            in_flight[copy.message_id] = future
                            future.add_done_callback(done(copy))
                        at += len(taken)
                        sent += len(taken)
                        if len(confirmed) >= PAGE:
                            flush()
                except BaseException:
                    following.cancel()
                    raise
                copies = await following
            await until_settled(lambda: not in_flight)
        finally:
            watchdog.cancel()
        flush()
        if marking is not None:
            await marking
        if refused:
            await asyncio.to_thread(self.store.unclaim, claimed.id, list(refused))
            result.refused = len(refused)
            reasons = sorted(set(refused.values()))
            return f"{len(refused)} not replayed: " + "; ".join(reasons)
        return None


@dataclass(frozen=True, slots=True)
class Copy:
    """A row's replay copy, ready to publish."""

    row_id: int
    message_id: str
    target: str
    body: bytes
    properties: spec.Basic.Properties


def _copy(row: dict[str, Any], claimed: Claimed, user: str,
          trace: ReplayTrace | None = None) -> Copy:
    source = stored_properties(row, contract.kept_on_replay)  # the rest would be stripped
    extra: dict[str, Any] = {REPLAY_ID: claimed.id}
    if trace is not None:
        extra.update(trace.copied(source.headers))
    properties = replay_properties(source, user, extra=extra)
    return Copy(row["id"], str(properties.message_id or f"row-{row['id']}"),
                claimed.to_queue or row["queue"], stored_body(row), properties)
