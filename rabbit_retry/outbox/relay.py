"""The relay: publishes what ``Outbox.add`` committed, marks it published once the broker
confirmed it (``rabbit-retry relay``, or ``Relay(...).run()`` / ``run_relay`` from Python).

A round takes a claim (a page of waiting events, ``store``), publishes its events with
``mandatory`` and publisher confirms, many in one socket write (``broker.batch``), and writes in
one transaction which were confirmed (``published``) and which the broker returned or refused
(``failed``: tried again on a schedule, then ``dead``). Several claims are in flight at once;
a relay killed at any moment has written nothing it has not seen confirmed, and the events it
had in flight are published again by the next relay: at most ``depth * batch`` duplicates, each
with its message id, which the consumer's ``Idempotency`` recognises.

Order: the events of one order key are published one at a time, each only once the broker
confirmed the one before; other keys and unkeyed events go out together. No two events with one
message id are in flight at once (the client matches a ``basic.return`` by message id).

When the broker closes the channel over one event (its exchange is gone, it is larger than the
broker allows), every event in flight on the channel fails with the same error. Those events are
then published again one at a time on a channel of their own, so that the one the broker refuses
is failed with the broker's reason and the others are published.

The broker unreachable or gone: the claims in flight keep what was confirmed and let go of the
rest, the relay stops publishing ("the circuit opens"), says so once, and tries to connect again
with capped backoff (``backoff.Backoff``); the first connection that works resumes publishing.
The database unreachable: the same, claims wait with backoff. Nothing spins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import aiormq
import aiormq.exceptions
from aiormq.abc import AbstractConnection
from pamqp import commands as spec

from rabbit_retry.backoff import Backoff
from rabbit_retry.broker.batch import publish_many
from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect_amqp
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.outbox.decide import (
    RetryPolicy,
    channel_refusal,
    missing_exchange,
    refusal,
)
from rabbit_retry.outbox.destinations import Destinations, destination_name
from rabbit_retry.outbox.event import outgoing
from rabbit_retry.outbox.metrics import RelayMetrics
from rabbit_retry.outbox.names import DEAD
from rabbit_retry.outbox.store import Claim, Failure, OnFailure, OutboxStore, Outcome, Row
from rabbit_retry.settings import Settings, mask, shown
from rabbit_retry.topology.resolved import Topology

log = logging.getLogger("rabbit_retry.outbox")

BATCH = 500  # events per claim
DEPTH = 4  # claims in flight at once: up to DEPTH * BATCH events unconfirmed
POLL_S = 0.1  # how often an idle relay looks for new events
CONFIRM_TIMEOUT_S = 60.0  # no confirm for this long while events wait for one: the broker is gone
LEASE_S = 15.0  # SQLite: how long the publishing relay's lease lasts unrenewed
SWEEP_EVERY_S = 60.0
ELSEWHERE_S = 0.5  # PostgreSQL: how long a key another relay has stays out of claims
Message = tuple[bytes, spec.Basic.Properties]


@dataclass
class Sent:
    """What became of a claim's events on the channel."""

    published: list[tuple[Row, datetime]] = field(default_factory=list)  # with the confirm time
    failed: list[Failure] = field(default_factory=list)
    # In flight when the channel or the connection went away (``broken``): unknown.
    suspects: list[Row] = field(default_factory=list)
    broken: BaseException | None = None

    def merge(self, other: Sent) -> None:
        self.published += other.published
        self.failed += other.failed


@dataclass
class Claimed:
    """A claim and its events' messages, built in the claim's thread."""

    claim: Claim
    messages: dict[int, Message]
    unreadable: list[Failure]


def _channel_error(error: BaseException) -> bool:
    """The broker closed the channel (over a publish), and not the connection."""
    return isinstance(error, aiormq.exceptions.ChannelClosed) and bool(
        getattr(error, "args", ()))


class Sender:
    """Publishes claims' events on one connection's confirming channel (and isolates the events
    a channel error leaves unknown on a second one)."""

    def __init__(self, connection: AbstractConnection, vhost: str, on_failure: OnFailure) -> None:
        self.connection = connection
        self.vhost = vhost
        self.hold = on_failure == "hold"
        self.channel: aiormq.abc.AbstractChannel | None = None
        self.in_flight: dict[str, asyncio.Future[object]] = {}  # by message id
        self.known: set[str] = {""}  # exchanges seen to exist (the default one always does)
        self.wakers: set[asyncio.Event] = set()
        # When the wait for confirms last moved: a confirm came, or publishing began after an
        # idle spell (``expect``); ``watch`` measures its deadline from here.
        self.last_confirm = time.monotonic()
        self._opening = asyncio.Lock()
        self._isolating = asyncio.Lock()
        self._alone: aiormq.abc.AbstractChannel | None = None

    async def main_channel(self) -> aiormq.abc.AbstractChannel:
        async with self._opening:
            if self.channel is None or self.channel.is_closed:
                self.channel = await self.connection.channel(publisher_confirms=True,
                                                             on_return_raises=True)
            return self.channel

    async def missing(self, exchanges: set[str]) -> set[str]:
        """Which of ``exchanges`` do not exist (a passive declare each, the first time): an
        event to one of those is failed without a publish that would close the channel."""
        gone = set()
        for name in sorted(exchanges - self.known):
            channel = await self.connection.channel()
            try:
                await channel.exchange_declare(name, passive=True)
                self.known.add(name)
            except aiormq.exceptions.ChannelNotFoundEntity:
                gone.add(name)
            finally:
                if not channel.is_closed:
                    await channel.close()
        return gone

    async def send(self, rows: list[Row], messages: dict[int, Message]) -> Sent:
        """Publish ``rows`` (a claim's, in the claim's order, which is each key's order:
        ``OutboxStore.claim``): each key's one at a time, the rest together; returns when
        every one is confirmed, refused or unknown."""
        sending = _Sending(self, rows, messages, await self.missing({r.exchange for r in rows}))
        self.wakers.add(sending.woke)
        try:
            while True:
                sending.refuse_gone()
                if sending.sent.broken is None and sending.ready:
                    await sending.publish_ready()
                if not sending.mine and (not sending.ready or sending.sent.broken is not None):
                    return sending.sent
                await sending.woke.wait()
                sending.woke.clear()
                sending.take_confirms()
        finally:
            self.wakers.discard(sending.woke)

    async def isolate(self, rows: list[Row], messages: dict[int, Message]) -> Sent:
        """Publish ``rows`` one at a time, each alone on a channel of its own: the broker's
        closing that channel is its verdict on that one event. Raises when the connection
        goes."""
        sent = Sent()
        async with self._isolating:
            self.known = {""}  # an exchange may have gone: look again
            for row in rows:
                if self._alone is None or self._alone.is_closed:
                    self._alone = await self.connection.channel(publisher_confirms=True,
                                                                on_return_raises=True)
                assert isinstance(self._alone, aiormq.Channel)
                [future] = await publish_many(self._alone, [(row.exchange, row.routing_key,
                                                              *messages[row.id])])
                try:
                    await asyncio.wait_for(asyncio.shield(future), CONFIRM_TIMEOUT_S)
                    sent.published.append((row, datetime.now(UTC)))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    reason = refusal(exc, row.exchange, row.routing_key)
                    if reason is None and _channel_error(exc) and not self.connection.is_closed:
                        reason = channel_refusal(exc)
                    if reason is None:
                        raise
                    sent.failed.append(Failure(row, reason))
        return sent

    def expect(self, message_id: str, future: asyncio.Future[object]) -> None:
        """A publish now waits for its confirm. After an idle spell the deadline starts here,
        not at the last confirm (minutes ago, perhaps: the watch would close a connection that
        was about to confirm)."""
        if not self.in_flight:
            self.last_confirm = time.monotonic()
        self.in_flight[message_id] = future

    async def watch(self, connection_lost: Callable[[str], None]) -> None:
        """One deadline for every publish: no confirm for ``CONFIRM_TIMEOUT_S`` while some wait
        means the broker stopped answering (a blocked connection, a network gone silent)."""
        while True:
            await asyncio.sleep(CONFIRM_TIMEOUT_S / 6)
            if self.in_flight and time.monotonic() - self.last_confirm > CONFIRM_TIMEOUT_S:
                connection_lost(f"no publisher confirm within {CONFIRM_TIMEOUT_S:g}s")
                await self.connection.close(TimeoutError(
                    f"no publisher confirm within {CONFIRM_TIMEOUT_S:g}s"))
                return


class Relay:
    """Publishes the outbox of the database at ``store`` to the broker of ``settings``.

    ``on_failure``: ``hold`` (a failed or dead event holds its key's later events) or
    ``continue``. ``keep``: how long published (and discarded) events stay in the table.
    ``migrate``: bring the schema up to date at start (else only check it)."""

    def __init__(self, store: str | OutboxStore, topology: str | os.PathLike[str] | Topology,
                 settings: Settings | None = None, *, keep: timedelta = timedelta(days=1),
                 on_failure: OnFailure = "hold", retry: RetryPolicy | None = None,
                 batch: int = BATCH, depth: int = DEPTH, poll: float = POLL_S,
                 migrate: bool = True, metrics_port: int | None = None) -> None:
        if on_failure not in ("hold", "continue"):
            raise InputError(f"on_failure: hold or continue, got {on_failure!r}")
        if batch < 1 or depth < 1:
            raise InputError("batch and depth: at least 1")
        if not isinstance(topology, Topology):
            from rabbit_retry.topology.load import load_topology

            topology = load_topology(Path(topology))
        self.store = OutboxStore(store, pool_size=depth + 2) if isinstance(store, str) else store
        self.settings = settings or Settings.from_env()
        self.destinations = Destinations.of(topology)
        self.keep = keep
        self.on_failure: OnFailure = on_failure
        self.retry = retry or RetryPolicy()
        self.batch, self.depth, self.poll = batch, depth, poll
        self.migrate = migrate
        self.metrics_port = metrics_port
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = RelayMetrics(self.destinations.names, self.store.figures)
        self.published = 0  # events this relay saw confirmed
        self.ready = asyncio.Event()  # the schema is up to date and the relay publishes
        self._stop = asyncio.Event()
        self._busy_ids: set[int] = set()  # SQLite: in flight in this relay's claims
        self._busy_keys: set[str] = set()  # in flight in this relay's claims
        self._elsewhere: dict[str, float] = {}  # PostgreSQL: key -> until when another has it
        self._leased = asyncio.Event()  # SQLite: this relay holds the lease
        self._lost: str | None = None  # why the broker connection went, for the log

    def stop(self) -> None:
        """Stop taking claims; ``run`` returns once the claims in flight are settled."""
        self._stop.set()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Publish until ``stop()`` (or ``stop`` is set)."""
        await asyncio.to_thread(self._prepare)
        watcher = asyncio.create_task(self._stop_when(stop)) if stop is not None else None
        if self.metrics_port is not None:
            port = self.metrics.serve(self.metrics_port)
            log.info("relay: metrics on port %d", port)
        background = [asyncio.create_task(self._housekeeping(), name="relay housekeeping")]
        if not self.store.locking:
            background.append(asyncio.create_task(self._lease(), name="relay lease"))
        else:
            self._leased.set()
        log.info("relay: publishing the outbox of %s to %s (%s)", shown(self.store.url),
                 self.settings.safe_url, "several relays share it" if self.store.locking
                 else "one relay at a time: SQLite")
        try:
            await self._circuit()
        finally:
            for task in [*background, *([watcher] if watcher else [])]:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if not self.store.locking:
                with suppress(Exception):
                    await asyncio.to_thread(self.store.drop_lease, self.owner)
            self.metrics.close()
            self.store.close()
            log.info("relay: stopped; %d events published", self.published)

    async def _stop_when(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stop()

    def _prepare(self) -> None:
        try:
            if self.migrate:
                self.store.migrate()
            else:
                self.store.check_schema()
        except (InputError, BrokerError):
            self.store.close()
            raise
        except Exception as exc:
            self.store.close()
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BrokerError(f"store {shown(self.store.url)}: cannot open or migrate it: "
                              f"{first}") from None

    async def _wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when asked to stop."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # --- the broker: connect, publish, reconnect ------------------------------------------------

    async def _circuit(self) -> None:
        backoff = Backoff(initial=0.5, maximum=30.0)
        down_since = 0.0
        while not self._stop.is_set():
            if not self._leased.is_set():
                await self._until(self._leased)
                continue
            try:
                connection = await connect_amqp(self.settings, name="rabbit-retry relay")
            except CONNECTION_ERRORS as exc:
                if backoff.failures == 0:
                    down_since = time.monotonic()
                    log.warning("relay: broker unreachable (%s); publishing stopped, trying "
                                "again with backoff", mask(str(exc)))
                await self._wait(backoff.failed())
                continue
            if backoff.failures:
                log.info("relay: broker back after %.1fs (%d attempts); publishing again",
                         time.monotonic() - down_since, backoff.succeeded())
            try:
                await self._publish(connection)
            except CONNECTION_ERRORS as exc:
                why = self._lost or _first_line(await _lost_with(connection, exc))
                self._lost = None
                down_since = time.monotonic()
                log.warning("relay: lost the broker (%s); publishing stopped, reconnecting "
                            "with backoff", why)
                await self._wait(backoff.failed())  # the next connect that works says so
            finally:
                self.metrics.publishing = 0
                with suppress(Exception):
                    await connection.close()

    async def _until(self, event: asyncio.Event) -> None:
        waiting = asyncio.create_task(event.wait())
        stopping = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            stopping.cancel()

    async def _publish(self, connection: AbstractConnection) -> None:
        """Claims in flight, up to ``depth``, until stopped (or the lease or the broker is
        lost: the claims in flight are settled first)."""
        sender = Sender(connection, self.settings.vhost, self.on_failure)
        await sender.main_channel()
        self.metrics.publishing = 1
        self.ready.set()

        def lost(why: str) -> None:
            self._lost = why

        watchdog = asyncio.create_task(sender.watch(lost))
        running: set[asyncio.Task[int]] = set()
        backoff = Backoff(initial=0.5, maximum=30.0)
        try:
            while not self._stop.is_set() and self._leased.is_set():
                self.metrics.beat()
                if connection.is_closed:  # noticed even while there is nothing to publish
                    raise _why_closed(connection)
                if len(running) >= self.depth:
                    await self._first_of(running)
                    continue
                try:
                    claimed = await self._claim()
                except CONNECTION_ERRORS:
                    raise
                except Exception as exc:  # the database: wait for it
                    if backoff.failures == 0:
                        log.warning("relay: cannot claim events (%s); trying again with backoff",
                                    _first_line(exc))
                    await self._wait(backoff.failed())
                    continue
                if backoff.failures:
                    log.info("relay: claiming works again (after %d attempts)",
                             backoff.succeeded())
                if not claimed.claim.rows:
                    await self._idle(running)
                    continue
                running.add(asyncio.create_task(self._carry(sender, claimed)))
                if len(claimed.claim.rows) < self.batch:
                    await self._idle(running)  # what was there is claimed: let it settle
        finally:
            try:  # the watch stays until the claims in flight end: a silent broker ends them
                results = await asyncio.gather(*running, return_exceptions=True)
            finally:
                watchdog.cancel()
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                        result, asyncio.CancelledError):
                    raise result

    async def _first_of(self, running: set[asyncio.Task[int]]) -> None:
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            running.discard(task)
            task.result()  # a lost broker ends the round here

    async def _idle(self, running: set[asyncio.Task[int]]) -> None:
        """Wait ``poll`` seconds, or less when a claim ends (it may free keys) or on stop."""
        if not running:
            await self._wait(self.poll)
            return
        done, _ = await asyncio.wait(running, timeout=self.poll,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            running.discard(task)
            task.result()

    async def _claim(self) -> Claimed:
        """Claim a page and build its messages (in a thread)."""
        clock = time.monotonic()
        for key, until in list(self._elsewhere.items()):
            if until <= clock:
                del self._elsewhere[key]
        busy_ids = frozenset(self._busy_ids)
        busy_keys = frozenset(self._busy_keys) | self._elsewhere.keys()

        def claim() -> Claimed:
            taken = self.store.claim(self.batch, on_failure=self.on_failure,
                                     busy_ids=busy_ids, busy_keys=busy_keys)
            messages: dict[int, Message] = {}
            unreadable = []
            for row in taken.rows:
                try:
                    messages[row.id] = outgoing(row.message_id, row.body, row.headers,
                                                row.properties, row.trace)
                except Exception as exc:  # written by hand, or damaged: never publishable
                    unreadable.append(Failure(row, "cannot read the stored event: "
                                                   f"{type(exc).__name__}: {exc}"))
            return Claimed(taken, messages, unreadable)

        claimed = await asyncio.to_thread(claim)
        rows = claimed.claim.rows
        # Another relay's keys: left out of the next claims for as long as a poll.
        for key in claimed.claim.elsewhere:
            self._elsewhere[key] = time.monotonic() + max(self.poll, ELSEWHERE_S)
        self._busy_keys.update(r.order_key for r in rows if r.order_key is not None)
        if not self.store.locking:
            self._busy_ids.update(r.id for r in rows)
        return claimed

    async def _carry(self, sender: Sender, claimed: Claimed) -> int:
        """Publish one claim and write what became of it; returns how many were published.
        Raises (after writing what is known) when the broker went away."""
        claim = claimed.claim
        # With hold, an event that cannot be read fails and holds its key: the key's later
        # events of this claim stay pending (the next claim holds them behind it).
        held = {f.row.order_key for f in claimed.unreadable
                if f.row.order_key is not None} if sender.hold else set()
        rows = [r for r in claim.rows if r.id in claimed.messages and r.order_key not in held]
        try:
            sent = await sender.send(rows, claimed.messages)
            sent.failed += claimed.unreadable
            broken = sent.broken
            if broken is not None and _channel_error(broken) and not sender.connection.is_closed:
                log.warning("relay: the broker closed the channel (%s); publishing the %d "
                            "events it left unconfirmed one at a time", mask(str(broken)),
                            len(sent.suspects))
                sent.merge(await sender.isolate(sorted(sent.suspects, key=lambda r: r.id),
                                                claimed.messages))
                broken = None
            try:
                outcomes = await asyncio.to_thread(
                    self.store.settle, claim, [row for row, _ in sent.published], sent.failed,
                    self.retry, self.owner)
            except Exception as exc:  # the database went away: these go out again later
                log.warning("relay: cannot mark %d confirmed events published (%s); they will "
                            "be published again", len(sent.published), _first_line(exc))
            else:
                self._count(sent, outcomes)
            if broken is not None:
                raise broken
            return len(sent.published)
        finally:
            await asyncio.to_thread(self.store.release, claim)  # nothing, once settled
            self._busy_ids.difference_update(r.id for r in claim.rows)
            self._busy_keys.difference_update(
                r.order_key for r in claim.rows if r.order_key is not None)

    def _count(self, sent: Sent, outcomes: list[Outcome]) -> None:
        self.published += len(sent.published)
        for row, at in sent.published:
            self.metrics.confirmed(destination_name(row.exchange, row.routing_key),
                                   row.created_at, at)
        reasons = {}
        for failure in sent.failed:
            self.metrics.failed(destination_name(failure.row.exchange, failure.row.routing_key))
            reasons[failure.row.id] = failure.reason
        for outcome in outcomes:
            row = outcome.row
            reason = reasons[row.id]
            log.warning("relay: event %s (message id %s, to %s) %s: %s", row.id, row.message_id,
                        destination_name(row.exchange, row.routing_key),
                        "is dead" if outcome.status == DEAD else
                        f"failed, tried again at {outcome.due_at:%H:%M:%S}", reason)

    # --- the store: lease, retention, heartbeat -------------------------------------------------

    async def _lease(self) -> None:
        """SQLite: hold the one relay's lease (renewed every third of it), or wait for it."""
        waiting_said = False
        loop = asyncio.get_running_loop()
        expiry: asyncio.TimerHandle | None = None

        def run_out() -> None:
            if self._leased.is_set():
                log.warning("relay: its lease may have run out (renewing it takes too long); "
                            "stops publishing until it is renewed")
                self._leased.clear()

        while True:
            asked = loop.time()
            try:
                held = await asyncio.to_thread(self.store.take_lease, self.owner, LEASE_S)
            except Exception as exc:
                log.warning("relay: cannot renew its lease (%s)", _first_line(exc))
                held = False
            if expiry is not None:
                expiry.cancel()
            if held:
                # Counted from before the renewal was asked (the store's clock started later):
                # a renewal slower than the lease (a locked database) must not leave this
                # relay publishing while another takes the lease over.
                expiry = loop.call_at(asked + LEASE_S * 0.8, run_out)
            if held and not self._leased.is_set():
                log.info("relay: holds the lease of %s; publishing", shown(self.store.url))
                waiting_said = False
            elif not held and self._leased.is_set():
                log.warning("relay: lost the lease of %s to another relay; waiting",
                            shown(self.store.url))
            elif not held and not waiting_said:
                log.info("relay: another relay publishes %s; waiting for its lease to run out",
                         shown(self.store.url))
                waiting_said = True
            (self._leased.set if held else self._leased.clear)()
            await asyncio.sleep(LEASE_S / 3)

    async def _housekeeping(self) -> None:
        swept_at = -SWEEP_EVERY_S
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            self.metrics.beat()
            if loop.time() - swept_at >= SWEEP_EVERY_S:
                try:
                    removed = await asyncio.to_thread(self.store.sweep, self.keep)
                    swept_at = loop.time()
                    if removed:
                        log.info("relay: removed %d events published more than %s ago",
                                 removed, self.keep)
                    failing = False
                except Exception as exc:
                    if not failing:
                        log.warning("relay: cannot remove old events (%s); trying again "
                                    "later", _first_line(exc))
                    failing = True
            await asyncio.sleep(5.0)


def _close_error(connection: AbstractConnection) -> Exception | None:
    """The error a closed connection ended with (the broker's reason, when it gave one)."""
    closing = connection.closing
    if closing.done() and not closing.cancelled():
        error = closing.exception()
        if isinstance(error, Exception):
            return error
    return None


def _why_closed(connection: AbstractConnection) -> BaseException:
    return _close_error(connection) or ConnectionError("the connection closed")


async def _lost_with(connection: AbstractConnection, exc: BaseException) -> BaseException:
    """What the connection ended with, else ``exc``. A publish on it can fail first with a bare
    "closed", before the broker's ``connection.close`` (and its reason) is read, so that is
    waited for a moment."""
    with suppress(Exception):
        await asyncio.wait_for(asyncio.shield(connection.closing), 1.0)
    return _close_error(connection) or exc


def _first_line(exc: BaseException) -> str:
    return mask((str(exc).strip().splitlines() or [type(exc).__name__])[0])


async def run_relay(store: str, topology: str | os.PathLike[str] | Topology,
                    settings: Settings | None = None, **options: Any) -> None:
    """``Relay(store, topology, settings, **options).run()``, stopped by SIGTERM or SIGINT."""
    import signal

    relay = Relay(store, topology, settings, **options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    try:
        await relay.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class _Sending:
    """One ``Sender.send``: per order key a chain of rows, each chain's head ready to go; the
    rows published and not confirmed yet (``mine``); the confirms that came back (``done``)."""

    def __init__(self, sender: Sender, rows: list[Row], messages: dict[int, Message],
                 gone: set[str]) -> None:
        self.sender, self.messages, self.gone = sender, messages, gone
        self.sent = Sent()
        self.chains: dict[object, deque[Row]] = {}
        for row in rows:
            self.chains.setdefault(_chain(row), deque()).append(row)
        self.ready = [chain[0] for chain in self.chains.values()]
        self.mine: dict[int, Row] = {}
        self.done: list[tuple[Row, asyncio.Future[object]]] = []
        self.woke = asyncio.Event()

    def advance(self, row: Row, ok: bool) -> None:
        """``row`` is settled: its chain's next row is ready (none after a failure, with
        ``hold``: a key's failed event holds the key's later ones back)."""
        chain = self.chains[_chain(row)]
        chain.popleft()
        if not ok and self.sender.hold:
            chain.clear()
        if chain:
            self.ready.append(chain[0])

    def refuse_gone(self) -> None:
        """Rows for an exchange that is not there fail at once (their chains go on)."""
        while refused := [r for r in self.ready if r.exchange in self.gone]:
            for row in refused:
                self.ready.remove(row)
                self.sent.failed.append(Failure(row, missing_exchange(row.exchange,
                                                                      self.sender.vhost)))
                self.advance(row, False)

    async def publish_ready(self) -> None:
        """Publish the ready rows in id order, but a message id already in flight (here or
        in another claim) waits for its confirm."""
        sender = self.sender
        batch, later, ids = [], [], set()
        for row in sorted(self.ready, key=lambda r: r.id):
            if row.message_id in sender.in_flight or row.message_id in ids:
                later.append(row)
            else:
                batch.append(row)
                ids.add(row.message_id)
        self.ready[:] = later
        if not batch:
            return
        try:
            channel = await sender.main_channel()
            assert isinstance(channel, aiormq.Channel)
            futures = await publish_many(channel, [
                (r.exchange, r.routing_key, *self.messages[r.id]) for r in batch])
        except CONNECTION_ERRORS as exc:
            self.sent.broken = exc
            self.sent.suspects += batch  # perhaps written, perhaps not
            return
        for row, future in zip(batch, futures, strict=True):
            sender.expect(row.message_id, future)
            self.mine[row.id] = row
            future.add_done_callback(partial(self.settled, row))

    def settled(self, row: Row, future: asyncio.Future[object]) -> None:
        sender = self.sender
        if sender.in_flight.get(row.message_id) is future:
            del sender.in_flight[row.message_id]
        sender.last_confirm = time.monotonic()
        self.done.append((row, future))
        for waker in sender.wakers:  # other claims may wait for this message id
            waker.set()

    def take_confirms(self) -> None:
        """What the confirms that came back say about this claim's rows."""
        at = datetime.now(UTC)
        while self.done:
            row, future = self.done.pop(0)
            if row.id not in self.mine:
                continue  # another claim's
            del self.mine[row.id]
            error = asyncio.CancelledError() if future.cancelled() else future.exception()
            if error is None:
                self.sent.published.append((row, at))
                self.advance(row, True)
            elif (reason := refusal(error, row.exchange, row.routing_key)) is not None:
                self.sent.failed.append(Failure(row, reason))
                self.advance(row, False)
            else:
                self.sent.broken = self.sent.broken or error
                self.sent.suspects.append(row)


def _chain(row: Row) -> object:
    """The chain a row goes in: its order key's, or one of its own."""
    return ("key", row.order_key) if row.order_key is not None else row.id
