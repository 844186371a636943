"""Parking queues into the store: consume, commit a batch, then ack it.

One channel consumes every parking queue of the topology. Deliveries collect while the previous
batch is being written; each batch is one transaction, and only once it committed does the
broker get one ``basic.ack(multiple)`` up to the batch's last delivery tag (every lower tag on the
channel belongs to this batch or an earlier, committed one). Killed at any point, what was not
acked goes back to its parking queue and is delivered again; the store's unique ``digest`` keeps
a copy committed before the kill from being stored twice. A store that fails (database down) is
retried with backoff while its batch stays unacked; a lost connection reconnects with backoff
(``backoff.Backoff``, both). Each copy is grouped by the store's grouping rules as they are when
its batch is written (an operator's rule added meanwhile applies from the next batch on).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiormq.exceptions
from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp import commands as spec

from rabbit_retry.backoff import Backoff
from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect
from rabbit_retry.desk.groups import Grouping
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.store import Store
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming

log = logging.getLogger("rabbit_retry.desk")

_LOST: tuple[type[BaseException], ...] = (
    BrokerError, aiormq.exceptions.AMQPError, *CONNECTION_ERRORS
)

BATCH = 1000  # copies per transaction at most
PREFETCH = 4 * BATCH  # deliveries keep arriving while a batch is written
LINGER_S = 0.02  # how long a small batch waits for company
RECHECK_S = 30.0  # how often a missing parking queue is looked for again
BACKOFF_MAX_S = 30.0
RECONNECT_FIRST_S = 1.0
STORE_RETRY_FIRST_S = 0.2


@dataclass
class IngestStats:
    stored: int = 0  # new rows
    seen: int = 0  # deliveries committed (duplicates included)
    missing: set[str] = field(default_factory=set)  # parking queues not found


class Ingest:
    """Consumes the parking queues of ``queues`` (main queue names) into ``store``."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        queues: Sequence[str],
        *,
        batch: int = BATCH,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.parking = {naming.parking_queue(q): q for q in queues}
        self.batch = batch
        self.prefetch = 4 * batch
        self.stats = IngestStats()
        self._on_batch = on_batch
        self._pending: list[tuple[str, DeliveredMessage]] = []
        self._arrived = asyncio.Event()
        self.consuming = asyncio.Event()  # set once every parking queue found is consumed
        self._grouping: tuple[int, Grouping] | None = None

    async def run(self) -> None:
        """Until cancelled: connect, consume, store; reconnect after a loss."""
        backoff = Backoff(RECONNECT_FIRST_S, BACKOFF_MAX_S)
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except _LOST as exc:
                delay = backoff.failed()
                log.warning("desk: ingest lost the broker (%s); again in %.0fs", exc, delay)
                self.consuming.clear()
                await asyncio.sleep(delay)
            else:
                backoff.succeeded()

    async def _session(self) -> None:
        connection = await connect(self.settings, name="rabbit-retry desk ingest")
        try:
            transport = connection.transport
            assert transport is not None
            amqp = transport.connection
            channel = await amqp.channel(publisher_confirms=False)
            await channel.basic_qos(prefetch_count=self.prefetch)

            cancelled = asyncio.Event()

            async def on_cancel(_frame: Any) -> None:
                # A parking queue deleted under the desk: start over, and look for it again.
                log.warning("desk: the broker cancelled a parking queue's consumer (deleted?)")
                cancelled.set()

            channel.on_consumer_cancel_callbacks.add(on_cancel)
            self._pending = []
            self._arrived.clear()
            flusher = asyncio.create_task(self._flush_forever(channel))
            try:
                waiting = set(self.parking)
                on_cancel_seen = asyncio.create_task(cancelled.wait())
                while True:
                    waiting = await self._consume_present(amqp, channel, waiting)
                    self.consuming.set()
                    done, _ = await asyncio.wait(
                        {flusher, on_cancel_seen, asyncio.ensure_future(channel.closing)},
                        timeout=RECHECK_S if waiting else None,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if on_cancel_seen in done:
                        raise BrokerError("a parking queue's consumer was cancelled")
                    if done:
                        for task in done:
                            task.result()  # raises what stopped it
                        raise BrokerError("the ingest channel closed")
            finally:
                flusher.cancel()
                on_cancel_seen.cancel()
                await asyncio.gather(flusher, on_cancel_seen, return_exceptions=True)
        finally:
            await connection.close()

    async def _consume_present(
        self, amqp: aiormq.abc.AbstractConnection, channel: AbstractChannel, waiting: set[str]
    ) -> set[str]:
        """Consume each parking queue in ``waiting`` that exists; returns those still missing."""
        missing = set()
        for parking_queue in sorted(waiting):
            probe = await amqp.channel(publisher_confirms=False)
            try:
                await probe.queue_declare(parking_queue, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                missing.add(parking_queue)
                if parking_queue not in self.stats.missing:
                    log.warning("desk: parking queue %r does not exist (run rabbit-retry apply);"
                                " looking again every %.0fs", parking_queue, RECHECK_S)
                continue
            finally:
                if not probe.is_closed:
                    await probe.close()
            await channel.basic_consume(
                parking_queue, self._arrival(self.parking[parking_queue]), no_ack=False
            )
            log.info("desk: consuming %s", parking_queue)
        self.stats.missing = missing
        return missing

    def _arrival(self, queue: str) -> Callable[[DeliveredMessage], Coroutine[Any, Any, None]]:
        async def arrive(message: DeliveredMessage) -> None:
            self._pending.append((queue, message))
            self._arrived.set()

        return arrive

    async def _flush_forever(self, channel: AbstractChannel) -> None:
        while True:
            await self._arrived.wait()
            if len(self._pending) < self.batch:
                await asyncio.sleep(LINGER_S)
            taken, self._pending = self._pending[: self.batch], self._pending[self.batch :]
            if not self._pending:
                self._arrived.clear()
            if not taken:  # what had arrived went with a lost connection (a new session began)
                continue
            await self._store(taken)
            last = max(_tag(m) for _, m in taken)
            await channel.basic_ack(last, multiple=True)

    def _current_grouping(self) -> tuple[int, Grouping]:
        """The store's grouping rules (read again only when their generation changed)."""
        generation = int(self.store.meta("grouping") or 0)
        if self._grouping is None or self._grouping[0] != generation:
            self._grouping = self.store.grouping()
        return self._grouping

    def _write(self, taken: list[tuple[str, DeliveredMessage]], moment: datetime) -> int:
        generation, grouping = self._current_grouping()
        rows = [parked(queue, m.body, m.header.properties, now=moment, grouping=grouping,
                       generation=generation) for queue, m in taken]
        first = [not getattr(m.delivery, "redelivered", False) for _, m in taken]
        return self.store.insert(rows, moment, first)

    async def _store(self, taken: list[tuple[str, DeliveredMessage]]) -> None:
        moment = datetime.now(UTC)
        backoff = Backoff(STORE_RETRY_FIRST_S, BACKOFF_MAX_S)
        while True:
            try:
                # Rows are made in the store's thread: the event loop goes on receiving.
                new = await asyncio.to_thread(self._write, taken, moment)
                break
            except Exception as exc:  # the database is down or refused: keep the batch unacked
                delay = backoff.failed()
                if backoff.failures == 1:
                    log.error("desk: storing %d parked messages failed (%s); retrying every "
                              "<= %.0fs, they stay in their parking queues", len(taken),
                              _one_line(exc), BACKOFF_MAX_S)
                await asyncio.sleep(delay)
        if failures := backoff.succeeded():
            log.info("desk: the store works again after %d failed attempts", failures)
        if new < len(taken):
            log.info("desk: %d of %d parked messages were stored already (delivered again after"
                     " a desk stopped between its commit and its ack)", len(taken) - new,
                     len(taken))
        self.stats.stored += new
        self.stats.seen += len(taken)
        if self._on_batch is not None:
            self._on_batch(len(taken), new)


def _tag(message: DeliveredMessage) -> int:
    delivery = message.delivery
    assert isinstance(delivery, spec.Basic.Deliver)
    return int(delivery.delivery_tag or 0)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]

