"""An operator's actions, carried out by this desk: discard (and the release of the ordered key a
discarded message held), restore, replay, edit and replay, cancel; and the replays other desks
left unfinished, taken over.

The store side of each is ``ledger.Ledger`` (one transaction with its audit entry); a replay's
publishing is ``replay.Replay``. This class holds what they share: the broker connection (one,
kept), this desk's name as a lease owner, and the replays it is running, with the lease each
one renews while it runs. A replay whose desk dies is finished by the desk that takes its lease
once it ran out (``adopt_abandoned``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import aiormq
from aiormq.abc import AbstractConnection
from pamqp import commands as spec

from rabbit_retry import contract, tracing
from rabbit_retry.broker.connect import connect
from rabbit_retry.desk.edits import edit
from rabbit_retry.desk.errors import DeskError, NotFound
from rabbit_retry.desk.ledger import Claimed, Ledger
from rabbit_retry.desk.records import stored_headers
from rabbit_retry.desk.replay import WINDOW, Replay, ReplayResult
from rabbit_retry.desk.store import Selection, Store
from rabbit_retry.settings import Settings

log = logging.getLogger("rabbit_retry.desk")

LEASE_S = 30.0
RATE_MAX = 100_000.0

__all__ = ["LEASE_S", "WINDOW", "Actions", "ReplayResult"]


class Actions:
    """Actions for one desk; ``queues`` are the topology's main queues."""

    def __init__(self, store: Store, settings: Settings, queues: set[str],
                 owner: str | None = None, lease: float = LEASE_S) -> None:
        self.store = store
        self.ledger = Ledger(store)
        self.settings = settings
        self.queues = queues
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease = lease
        self._connection: Any = None
        self._amqp: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self.running: dict[str, tuple[Replay, asyncio.Task[ReplayResult]]] = {}

    def check_queue(self, to: str | None) -> None:
        if to is not None and to not in self.queues:
            known = ", ".join(sorted(self.queues))
            raise DeskError(f'"to": {to!r} is not a queue of the topology (one of: {known})')

    async def discard(self, selection: Selection, actor: str, reason: str) -> int:
        if not reason.strip():
            raise DeskError('"reason": a discard needs a reason')
        count = await asyncio.to_thread(self.ledger.discard, selection, actor, reason.strip())
        try:
            await self.send_releases()
        except Exception as exc:  # kept pending: housekeeping sends them once it can
            log.warning("desk: releasing the ordered keys of discarded messages failed (%s); "
                        "trying again", _one_line(exc))
        return count

    async def send_releases(self) -> int:
        """Let go of the ordered keys that discarded messages held: to each one's queue, as a
        replay goes, the release (``contract.release_headers``), confirmed before it is marked
        sent (a release sent twice is harmless: the hold is gone after the first)."""
        sent = 0
        while rows := await asyncio.to_thread(self.ledger.pending_releases):
            channel = await self._channel()
            done: list[int] = []
            try:
                for row in rows:
                    headers = contract.release_headers(stored_headers(row))
                    if headers is not None:
                        try:
                            await channel.basic_publish(
                                b"", exchange="", routing_key=row["queue"], mandatory=True,
                                properties=spec.Basic.Properties(
                                    headers=headers, delivery_mode=2,
                                    message_id=contract.new_message_id()))
                        except aiormq.exceptions.PublishError:
                            # Returned: no queue of that name any more, so no key it holds.
                            log.warning("desk: the ordered key of a discarded message of %r is"
                                        " not released: the queue is gone", row["queue"])
                    done.append(row["id"])
            finally:
                with suppress(Exception):
                    await channel.close()
                # What went out is marked, also when a later one failed (the rest stay pending).
                await asyncio.to_thread(self.ledger.released, done)
            sent += len(done)
        return sent

    async def restore(self, selection: Selection, actor: str, reason: str | None) -> int:
        return await asyncio.to_thread(self.ledger.restore, selection, actor,
                                       reason.strip() if reason and reason.strip() else None)

    async def replay(self, selection: Selection, actor: str, *, to: str | None = None,
                     rate: float | None = None) -> tuple[Replay, asyncio.Task[ReplayResult]]:
        """Take the selection and start publishing it; the task ends with the replay."""
        self.check_queue(to)
        if rate is not None and not 0 < rate <= RATE_MAX:
            raise DeskError(f'"rate": messages per second, above 0 and at most {RATE_MAX:,.0f}')
        replay_id, taken = await asyncio.to_thread(
            self.ledger.start_replay, selection, actor, self.owner, to_queue=to, rate=rate,
            lease=self.lease,
        )
        return await self._run(Claimed(replay_id, to, rate), taken, actor)

    async def edit(self, row_id: int, actor: str, *, body: bytes | None,
                   headers: Mapping[str, Any] | None, to: str | None,
                   reason: str | None) -> tuple[Replay, asyncio.Task[ReplayResult]]:
        """Replay one parked message with an operator's changes; the stored one stays as it
        was, the audit keeps the change."""
        self.check_queue(to)
        row = await asyncio.to_thread(self.store.message, row_id)
        if row is None:
            raise NotFound(f"no message {row_id}")
        edited = edit(row, body=body, headers=headers)
        replay_id = await asyncio.to_thread(
            self.ledger.start_edit, row_id, actor, self.owner, body=edited.body,
            headers=edited.headers, detail=edited.detail, to_queue=to, reason=reason,
            lease=self.lease)
        return await self._run(Claimed(replay_id, to, None, edited.body, edited.headers), 1,
                               actor)

    async def cancel(self, replay_id: str, actor: str) -> None:
        """Stop a replay: this desk's at once; another desk's within a few rows."""
        await asyncio.to_thread(self.ledger.cancel, replay_id, actor)
        running = self.running.get(replay_id)
        if running is not None:
            running[0].cancel(actor)

    async def _run(self, claimed: Claimed, taken: int,
                   actor: str | None = None) -> tuple[Replay, asyncio.Task[ReplayResult]]:
        channel = await self._channel()
        replay = Replay(self.ledger, channel, claimed, self.settings.user)
        replay.result.claimed = taken
        task = asyncio.create_task(self._carry_out(replay, channel, actor))
        self.running[claimed.id] = (replay, task)
        task.add_done_callback(lambda _t: self.running.pop(claimed.id, None))
        return replay, task

    async def _carry_out(self, replay: Replay, channel: aiormq.Channel,
                         actor: str | None) -> ReplayResult:
        """The replay's span (where the desk traces) is current for all of it; every copy
        carries it (``rabbit_retry.tracing``). A replay taken over from another desk says so
        and names no actor: the audit entry has it."""
        lease = asyncio.create_task(self._keep_lease(replay))
        claimed = replay.claimed
        name = "desk edit and replay" if claimed.edit_headers is not None else "desk replay"
        try:
            with tracing.replay_span(name, {
                "rabbit_retry.actor": actor, "rabbit_retry.replay.id": claimed.id,
                "rabbit_retry.replay.resumed": replay.result.claimed < 0,
                "rabbit_retry.replay.to": claimed.to_queue,
            }) as trace:
                replay.trace = trace
                result = await replay.run()
                if trace is not None:
                    trace.replayed(result.replayed)
                return result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("desk: replay %s stopped (%s); it goes on once its lease runs out",
                      replay.claimed.id, _one_line(exc))
            raise
        finally:
            lease.cancel()
            with suppress(Exception):
                await channel.close()

    async def _keep_lease(self, replay: Replay) -> None:
        """Renew the replay's lease every third of it. A renewal that fails (the store) is
        tried again at the next; once the lease may have run out (two thirds of it without a
        renewal), the replay stops here, as when another desk took it: the desk that takes it
        over then is the only one publishing it."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                held = await asyncio.to_thread(self.ledger.renew, replay.claimed.id, self.owner,
                                               self.lease)
            except Exception as exc:
                if time.monotonic() - renewed < self.lease * 2 / 3:
                    log.warning("desk: replay %s: renewing its lease failed (%s); trying again",
                                replay.claimed.id, _one_line(exc))
                    continue
                held = False
            if not held:
                log.error("desk: replay %s: its lease is lost or may have run out; stopping "
                          "here (the desk that takes it over finishes it)", replay.claimed.id)
                with suppress(Exception):
                    await replay.channel.close()
                return
            renewed = time.monotonic()

    async def adopt_abandoned(self) -> int:
        """Take over every replay whose desk stopped renewing its lease; returns how many."""
        taken = 0
        while (claimed := await asyncio.to_thread(self.ledger.take_abandoned, self.owner,
                                                  self.lease)) is not None:
            message = (f"desk: resuming replay {claimed.id}, left unfinished by a desk that "
                       f"stopped: re-sending the {claimed.resent} copies it had out, not yet "
                       "confirmed (they may arrive twice)")
            log.warning(message)
            print(f"rabbit-retry {message.removeprefix('desk: ')}", flush=True)
            earlier = self.running.get(claimed.id)
            if earlier is not None:  # this desk's own run, stopping after its lease ran out
                await asyncio.wait({earlier[1]})
            try:
                await self._run(claimed, -1)
            except Exception:
                # Not started (the broker is away): the next round takes it again at once.
                await asyncio.to_thread(self.ledger.renew, claimed.id, self.owner, 0)
                raise
            taken += 1
        return taken

    async def close(self) -> None:
        for _, task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*(t for _, t in self.running.values()), return_exceptions=True)
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


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
