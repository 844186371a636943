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

Replayed copies get the CLI's replay properties (``parking.headers.replay_properties``: parking
and death headers stripped, ``retry-count`` reset, ``replay-count`` + 1, a per-message TTL back)
and ``replay-id``; an edited copy (edit and replay) is published with the operator's body and
headers and ``replay-edited``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiormq
import aiormq.exceptions
from pamqp import commands as spec

from rabbit_retry import contract
from rabbit_retry.backoff import Backoff
from rabbit_retry.broker.batch import publish_batch
from rabbit_retry.desk.ledger import Claim, Claimed, Ledger
from rabbit_retry.desk.records import generated_message_id, stored_body, stored_properties
from rabbit_retry.parking.headers import replay_properties

if TYPE_CHECKING:
    from rabbit_retry.tracing.replay import ReplayTrace

log = logging.getLogger("rabbit_retry.desk")

WINDOW = 512  # rows claimed and not yet settled (copies out, or about to be), at most
CHUNK = 128  # rows claimed (and answered rows settled) in one transaction
SETTLE_MIN = 64  # answered rows written without waiting for the next claim
SETTLE_RETRY_FIRST_S, SETTLE_RETRY_MAX_S = 0.5, 10.0  # writing them again after a store error
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


def copy_of(row: dict[str, Any], claimed: Claimed, user: str,
            trace: ReplayTrace | None = None) -> Copy:
    """The copy a replay publishes for a stored row (an edit's body and headers when it is one):
    the CLI's replay properties (``parking.headers.replay_properties``), the replay's id, and
    its span when the desk traces."""
    extra: dict[str, Any] = {contract.REPLAY_ID: claimed.id}
    if claimed.edit_headers is not None:
        source = stored_properties({**row, "headers_raw": claimed.edit_headers})
        extra[contract.REPLAY_EDITED] = True
        body = claimed.edit_body if claimed.edit_body is not None else stored_body(row)
    else:
        source = stored_properties(row, contract.kept_on_replay)  # the rest would be stripped
        body = stored_body(row)
    if not source.message_id:
        source.message_id = generated_message_id(row["digest"])
        extra[contract.MESSAGE_ID_GENERATED] = True
    if trace is not None:
        extra.update(trace.copied(source.headers))
    properties = replay_properties(source, user, extra=extra)
    return Copy(row["id"], str(properties.message_id), claimed.to_queue or row["queue"], body,
                properties)


@dataclass
class _Flight:
    """What is out: copies awaiting their confirm (by message id: aiormq matches a return to its
    publish by it, so one id is never out twice), rows confirmed or refused and not yet written,
    rows claimed and not yet settled (the window bounds these)."""

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
        # The publisher waits (for its rate, for room, for an earlier copy, for the last
        # answers): what the broker answered meanwhile is written at once, not at the next claim.
        self._idle = False
        self._writing = asyncio.Lock()
        self.trace: ReplayTrace | None = None  # the replay's span, where the desk traces

    def cancel(self, actor: str) -> None:
        """Stop claiming; what is out settles, what was not claimed goes back to parked."""
        if self.state is State.PUBLISHING:
            self.cancelled_by = actor
            self.state = State.CANCELLING
            self._flight.changed.set()

    async def run(self) -> ReplayResult:
        helpers = [asyncio.create_task(self._watch()),
                   asyncio.create_task(self._settle_meanwhile())]
        try:
            await self._publish()
            if self.state is State.PUBLISHING:
                self.state = State.DRAINING
            with self._waiting():
                await self._until(lambda: self._flight.unsettled == 0)
        except BaseException:
            self.state = State.STOPPED
            raise
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        await self._end()
        return self.result

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        self._idle = True
        self._flight.changed.set()
        try:
            yield
        finally:
            self._idle = False

    def _answered(self) -> int:
        return len(self._flight.confirmed) + len(self._flight.refused)

    async def _settle_meanwhile(self) -> None:
        """Write the broker's answers while the publisher waits, or once they are many. A
        store that fails is tried again (the answers stay in memory meanwhile): the replay
        waits for them, and a helper that died of it would leave it waiting for good."""
        backoff = Backoff(SETTLE_RETRY_FIRST_S, SETTLE_RETRY_MAX_S)
        while True:
            await self._until(lambda: self._answered() > 0 and (
                self._idle or self._answered() >= SETTLE_MIN))
            try:
                await self._step(0, 0)
            except Exception as exc:
                if backoff.failures == 0:
                    log.warning("desk: replay %s: writing what the broker confirmed failed (%s);"
                                " trying again", self.claimed.id, exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()

    def _room(self) -> int:
        """Rows the next step may claim: the window less the rows claimed and not settled once
        this step settled what the broker answered so far."""
        return self.window - (self._flight.unsettled - self._answered())

    async def _step(self, after: int, limit: int) -> Claim:
        """Write what the broker answered (confirmed rows settled, refused ones parked again)
        and claim the next rows, in one transaction."""
        flight = self._flight
        async with self._writing:
            confirmed, flight.confirmed = flight.confirmed, []
            refused, flight.refused = flight.refused, {}
            try:
                claim = await asyncio.to_thread(self.ledger.step, self.claimed.id, confirmed,
                                                list(refused), after, limit)
            except BaseException:  # not written: the next step writes them
                flight.confirmed[:0] = confirmed
                flight.refused = {**refused, **flight.refused}
                raise
            flight.unsettled -= len(confirmed) + len(refused)
        self.result.replayed += len(confirmed)
        self.result.refused += len(refused)
        self._reasons.update(refused.values())
        flight.changed.set()
        return claim

    async def _publish(self) -> None:
        """Claim and send, a chunk at a time. Once cancelled, the rows an earlier run of this
        replay claimed (a desk that died: their copies may be out) are still sent again and
        settled; nothing more is claimed."""
        after = 0
        while self.state in (State.PUBLISHING, State.CANCELLING):
            with self._waiting():
                await self._until(lambda: self._room() >= self.chunk)
            claim = await self._step(after, self.chunk)
            if claim.cancel_by is not None:
                self.cancel(claim.cancel_by)
            if not claim.rows:
                return
            after = claim.rows[-1]["id"]
            self._flight.unsettled += len(claim.rows)
            await self._send([copy_of(row, self.claimed, self.user, self.trace)
                              for row in claim.rows])

    async def _send(self, copies: list[Copy]) -> None:
        """Publish ``copies`` in batches: one target and no message id twice per batch, none
        already out, at the replay's rate."""
        at = 0
        while at < len(copies):
            if self.claimed.rate:
                ahead = self._started + self._sent / self.claimed.rate - time.monotonic()
                if ahead > 0:
                    with self._waiting():
                        await asyncio.sleep(ahead)
            earlier = self._flight.out.get(copies[at].message_id)
            if earlier is not None:
                with self._waiting():
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
        outcome: str | None = None
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
