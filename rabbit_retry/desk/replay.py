"""One replay, carried out: claim a few rows, publish their copies (``mandatory``, confirmed),
settle each row once the broker confirmed its copy, until none is left or an operator cancels.

States (``Replay.state``)::

    publishing --(no row left)--> draining --> done | failed
        |                                         ^
        +--(cancel)--> cancelling --(drained)-----+--> cancelled
        +--(the channel or store fails)--> stopped (its lease runs out; a desk takes it over)

The window bounds how many rows are claimed and not yet settled: rows whose copies may be out
and are not recorded as confirmed. A desk killed at any point leaves at most ``WINDOW`` such
rows; the desk that takes the replay over re-sends those (the audit counts them: they may arrive
twice) and nothing else. A copy the broker returns (no such queue) or refuses (a full queue)
parks its row again and the audit says why; the replay goes on with the rest.

Replayed copies get the CLI's replay headers (``parking.headers.replay_headers``: parking and
death headers stripped, ``retry-count`` reset, ``replay-count`` + 1) and ``replay-id``; an edited
copy (edit and replay) is published with the operator's body and headers and ``replay-edited``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiormq
import aiormq.exceptions
from pamqp import commands as spec

from rabbit_retry import contract, wire
from rabbit_retry.broker.batch import publish_batch
from rabbit_retry.desk.ledger import Claimed, Ledger
from rabbit_retry.desk.records import stored_body, stored_properties
from rabbit_retry.parking.headers import replay_headers

log = logging.getLogger("rabbit_retry.desk")

WINDOW = 512  # rows claimed and not yet settled (copies out, or about to be), at most
CHUNK = 128  # rows claimed at a time
CONFIRM_TIMEOUT_S = 60.0


class State(enum.Enum):
    PUBLISHING = "publishing"
    CANCELLING = "cancelling"  # an operator asked it to stop: no new claims, in flight settles
    DRAINING = "draining"  # every row claimed: waiting for the last confirms
    DONE = "done"
    FAILED = "failed"  # ended with copies the broker refused (their rows parked again)
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # the channel, the store or the lease failed: another run finishes it

    @property
    def ended(self) -> bool:
        return self in (State.DONE, State.FAILED, State.CANCELLED, State.STOPPED)


@dataclass
class ReplayResult:
    replay_id: str
    claimed: int
    replayed: int = 0
    refused: int = 0
    resent: int = 0
    state: State = State.PUBLISHING
    outcome: str | None = None

    @property
    def done(self) -> bool:
        return self.state.ended


@dataclass(frozen=True, slots=True)
class Copy:
    """A row's replay copy, ready to publish."""

    row_id: int
    message_id: str
    target: str
    body: bytes
    properties: spec.Basic.Properties


def copy_of(row: dict[str, Any], claimed: Claimed, user: str) -> Copy:
    """The copy a replay publishes for a stored row (an edit's body and headers when it is one)."""
    if claimed.edit_headers is not None:
        source = stored_properties({**row, "headers_raw": claimed.edit_headers})
        headers = replay_headers(source.headers)
        headers[contract.REPLAY_EDITED] = True
        body = claimed.edit_body if claimed.edit_body is not None else stored_body(row)
    else:
        source = stored_properties(row, contract.kept_on_replay)  # the rest would be stripped
        headers = replay_headers(source.headers)
        body = stored_body(row)
    headers[contract.REPLAY_ID] = claimed.id
    properties = contract.republish_properties(source, headers, user)
    return Copy(row["id"], str(properties.message_id), claimed.to_queue or row["queue"], body,
                properties)


@dataclass
class _Flight:
    """What is out: copies awaiting their confirm (by message id: aiormq matches a return to its
    publish by it, so one id is never out twice), rows confirmed or refused and not yet written,
    rows claimed and not yet settled."""

    out: dict[str, asyncio.Future[object]] = field(default_factory=dict)
    confirmed: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    unsettled: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    failure: BaseException | None = None
    last_confirm: float = field(default_factory=time.monotonic)


class Replay:
    """One run of one replay by this desk (a replay taken over is a new run)."""

    def __init__(self, ledger: Ledger, channel: aiormq.Channel, claimed: Claimed, user: str,
                 *, window: int = WINDOW, chunk: int = CHUNK) -> None:
        self.ledger = ledger
        self.channel = channel
        self.claimed = claimed
        self.user = user
        self.window = window
        # A rate claims about a second's worth at a time: a claimed row waiting for its turn
        # would be re-sent, needlessly, by a desk taking the replay over.
        self.chunk = max(1, min(chunk, int(claimed.rate))) if claimed.rate else chunk
        self.state = State.PUBLISHING
        self.result = ReplayResult(claimed.id, -1, resent=claimed.resent)
        self.cancelled_by: str | None = None
        self._flight = _Flight()
        self._started = time.monotonic()
        self._sent = 0
        self._reasons: set[str] = set()
        self.on_end: Callable[[Replay], None] | None = None

    def cancel(self, actor: str) -> None:
        """Stop claiming; what is out settles, what was not claimed goes back to parked."""
        if self.state is State.PUBLISHING:
            self.cancelled_by = actor
            self.state = State.CANCELLING
            self._flight.changed.set()

    async def run(self) -> ReplayResult:
        settler = asyncio.create_task(self._settle_forever())
        watchdog = asyncio.create_task(self._watch())
        try:
            await self._publish()
            self.state = State.CANCELLING if self.state is State.CANCELLING else State.DRAINING
            await self._until(lambda: not self._flight.out and self._flight.unsettled == 0)
        except BaseException:
            self.state = State.STOPPED
            raise
        finally:
            watchdog.cancel()
            settler.cancel()
            await asyncio.gather(settler, watchdog, return_exceptions=True)
        await self._end()
        return self.result

    async def _publish(self) -> None:
        after = 0
        while self.state is State.PUBLISHING:
            room = self.window - self._flight.unsettled
            if room < min(self.chunk, self.window):
                await self._until(lambda: self.state is not State.PUBLISHING
                                  or self.window - self._flight.unsettled >= self.chunk)
                continue
            claim = await asyncio.to_thread(self.ledger.claim, self.claimed.id, after,
                                            min(room, self.chunk))
            if claim.cancel_by is not None:
                self.cancel(claim.cancel_by)
                return
            if not claim.rows:
                return
            after = claim.rows[-1]["id"]
            self._flight.unsettled += len(claim.rows)
            copies = [copy_of(row, self.claimed, self.user) for row in claim.rows]
            await self._send(copies)

    async def _send(self, copies: list[Copy]) -> None:
        """Publish ``copies`` in batches: one target and no message id twice per batch, none
        already out, at the replay's rate."""
        at = 0
        while at < len(copies):
            if self.claimed.rate:
                ahead = self._started + self._sent / self.claimed.rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            earlier = self._flight.out.get(copies[at].message_id)
            if earlier is not None:
                await self._until(earlier.done)
            taken = self._batch(copies, at)
            futures = await publish_batch(self.channel, taken[0].target,
                                          [(c.body, c.properties) for c in taken])
            for copy, future in zip(taken, futures, strict=True):
                self._flight.out[copy.message_id] = future
                future.add_done_callback(self._settled(copy))
            at += len(taken)
            self._sent += len(taken)
            if self._flight.failure is not None:
                raise self._flight.failure

    def _batch(self, copies: list[Copy], at: int) -> list[Copy]:
        room = len(copies) - at
        if self.claimed.rate:
            due = int((time.monotonic() - self._started) * self.claimed.rate) - self._sent
            room = min(room, max(1, due))
        taken: list[Copy] = []
        ids: set[str] = set()
        for copy in copies[at:at + room]:
            if taken and (copy.message_id in ids or copy.message_id in self._flight.out
                          or copy.target != taken[0].target):
                break
            ids.add(copy.message_id)
            taken.append(copy)
        return taken

    def _settled(self, copy: Copy) -> Callable[[asyncio.Future[object]], None]:
        flight = self._flight

        def settle(future: asyncio.Future[object]) -> None:
            flight.last_confirm = time.monotonic()
            if flight.out.get(copy.message_id) is future:
                del flight.out[copy.message_id]
            flight.changed.set()
            error = None if future.cancelled() else future.exception()
            if future.cancelled():
                flight.failure = flight.failure or asyncio.CancelledError()
            elif error is None:
                flight.confirmed.append(copy.row_id)
            elif isinstance(error, aiormq.exceptions.PublishError):
                flight.refused[copy.row_id] = (f"queue {copy.target!r} does not exist (the "
                                               "broker returned it)")
            elif isinstance(error, aiormq.exceptions.DeliveryError):
                flight.refused[copy.row_id] = f"queue {copy.target!r} refused it (full?)"
            else:
                flight.failure = flight.failure or error  # the channel closed: stop here

        return settle

    async def _until(self, ready: Callable[[], bool]) -> None:
        flight = self._flight
        while not ready():
            if flight.failure is not None:
                raise flight.failure
            flight.changed.clear()
            await flight.changed.wait()
        if flight.failure is not None:
            raise flight.failure

    async def _settle_forever(self) -> None:
        """Write what the broker said, as it says it: confirmed rows settled, refused rows
        parked again. Each write makes room in the window."""
        flight = self._flight
        while True:
            if not flight.confirmed and not flight.refused:
                flight.changed.clear()
                await flight.changed.wait()
                continue
            confirmed, flight.confirmed = flight.confirmed, []
            refused, flight.refused = flight.refused, {}
            try:
                if confirmed:
                    self.result.replayed += await asyncio.to_thread(
                        self.ledger.settle, self.claimed.id, confirmed)
                if refused:
                    await asyncio.to_thread(self.ledger.unclaim, self.claimed.id, list(refused))
                    self.result.refused += len(refused)
                    self._reasons.update(refused.values())
            except Exception as exc:  # the store failed: stop; the next run re-sends these
                flight.failure = flight.failure or exc
                flight.changed.set()
                return
            flight.unsettled -= len(confirmed) + len(refused)
            flight.changed.set()

    async def _watch(self) -> None:
        """One deadline for every copy instead of a timer each: no confirm (or return) for
        ``CONFIRM_TIMEOUT_S`` while copies are out closes the channel, which fails them; the
        replay stops and resumes when its lease runs out."""
        flight = self._flight
        while True:
            await asyncio.sleep(CONFIRM_TIMEOUT_S / 6)
            if flight.out and time.monotonic() - flight.last_confirm > CONFIRM_TIMEOUT_S:
                log.error("desk: replay %s: no publisher confirm for %gs; stopping it",
                          self.claimed.id, CONFIRM_TIMEOUT_S)
                await self.channel.close(TimeoutError(
                    f"no publisher confirm within {CONFIRM_TIMEOUT_S:g}s"))
                return

    async def _end(self) -> None:
        outcome = None
        if self.state is State.CANCELLING:
            released = await asyncio.to_thread(self.ledger.release, self.claimed.id)
            state = State.CANCELLED
            outcome = f"cancelled by {self.cancelled_by}; {released} left parked"
        elif self.result.refused:
            state = State.FAILED
            outcome = (f"{self.result.refused} not replayed: "
                       + "; ".join(sorted(self._reasons)))
        else:
            state = State.DONE
        self.result.replayed = await asyncio.to_thread(self.ledger.finish, self.claimed.id,
                                                       state.value, outcome)
        self.state = self.result.state = state
        self.result.outcome = outcome
        log.info("desk: replay %s %s: %d replayed%s", self.claimed.id, state.value,
                 self.result.replayed, f"; {outcome}" if outcome else "")


async def close_quietly(channel: Any) -> None:
    with suppress(Exception):
        await channel.close()


def edited_table(headers: dict[str, Any]) -> bytes:
    """An edit's headers as the AMQP field table the store keeps."""
    return wire.encode_table(headers)
