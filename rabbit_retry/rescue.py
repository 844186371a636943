"""``rabbit-retry rescue``: move the messages RabbitMQ's dead-letter cycle check holds in a main
queue ``Q`` to ``Q.parking`` (docs/versions.md, "Stranded messages").

What the broker does (RabbitMQ's ``rabbit_fifo_dlx_worker``; measured on 4.3.6): a quorum
queue's at-least-once dead-lettering keeps a message whose only route is refused as a cycle in
the queue's dead-letter store, and tries its routes again every
``dead_letter_worker_publisher_confirm_timeout`` (180 s by default; read once, when the queue's
dead-letter worker starts). Each time it routes through ``Q.retry`` again, drops the routes the
cycle check refuses, sends to the others, and lets go of the message once every queue it was
routed to has confirmed, or once no route is left and at least one queue has confirmed.

So, from ``Q`` (``Q.retry`` is an exchange a queue can be bound to):

1. bind ``Q.rescue`` to ``Q.retry`` with routing key ``Q``, the first tier's binding kept: at
   the broker's next try the stranded messages reach ``Q.rescue``, which confirms; ``Q`` keeps
   its own (the tier never confirms). What ``Q.rescue`` also gets is a copy of each message
   ``Q`` dead-letters meanwhile (a worker's ``nack``): its tier copy is the real one;
2. once ``Q.rescue`` holds as many stranded messages as ``Q`` holds, unbind ``Q.rescue`` and
   the first tier's ``Q`` binding: at the broker's next try (one interval after step 1's) no
   route is left and ``Q.rescue`` had confirmed, so ``Q`` lets go. A ``nack`` meanwhile waits
   in ``Q``'s dead-letter store, and goes on to the tier once it is bound again;
3. bind the tier again, publish each stranded message to ``Q.parking`` (confirmed, then acked
   in ``Q.rescue``), drop the copies of step 1, delete ``Q.rescue``.

A stranded message is told from a copy as the broker tells a cycle (``is_dead_letter_cycle``,
``mc:is_death_cycle``): its ``x-death`` names the first tier with no ``rejected`` since.

The messages of ``Q.rescue`` are held unacknowledged until step 3, so a run that dies leaves
them there, and bindings are put back as the file has them on the way out. A second run starts
again at step 1 with what ``Q.rescue`` holds: whatever step it stopped at, it finishes. Killed
between a parked copy's confirm and its ack in ``Q.rescue``, a run leaves one duplicate in
``Q.parking``.

From a tier nothing can be done by a client: it dead-letters to the default exchange with
routing key ``Q``, whose only route is ``Q``, the cycle; queue arguments win over a policy's
``dead-letter-exchange``, ``dead-letter-routing-key`` and ``dead-letter-strategy``; and what
would move the message (a purge, a delete, a policy's ``overflow: drop-head`` that switches the
queue to at-most-once dead-lettering) deletes it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel
from pamqp import commands as spec

from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect
from rabbit_retry.broker.management import Management
from rabbit_retry.contract import X_DEATH, as_text, new_message_id, republish_properties
from rabbit_retry.errors import BrokerError, ConflictError
from rabbit_retry.settings import Settings, mask
from rabbit_retry.status import QueueStatus, Status, read_status
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.compile import PARKING_DELIVERY_LIMIT
from rabbit_retry.topology.plan import Binding, Plan
from rabbit_retry.worker import copies, history

# The broker's default retry interval for held dead letters (its publisher confirm timeout).
DEFAULT_INTERVAL_S = 180.0
# Added to each wait for the broker: the management API's counts lag by a few seconds.
SLACK_S = 30.0
POLL_S = 1.0
PROGRESS_EVERY_S = 15.0
PUBLISH_TIMEOUT_S = 60.0
# The argument that marks a Q.rescue as ours: a queue of that name without it is refused.
RESCUE_OF = "rabbit-retry-rescue-of"
PARKED_REASON = "stranded"
STRANDED_FAILURE = "rabbit_retry.rescue.StrandedByDeadLetterCycle"

Say = Callable[[str], None]


# --- pure ---------------------------------------------------------------------------------------


def is_dead_letter_cycle(target: str, deaths: object) -> bool:
    """Whether RabbitMQ refuses to dead-letter a message with this ``x-death`` (newest entry
    first) into ``target`` for any reason but ``rejected``: ``target`` is among the queues it
    died in, and no entry from the newest to ``target``'s says ``rejected``
    (``mc:is_death_cycle``)."""
    if not isinstance(deaths, list | tuple):
        return False
    seen: list[str | None] = []
    for entry in deaths:
        if not isinstance(entry, Mapping):
            continue
        seen.append(as_text(entry.get("reason")))
        if as_text(entry.get("queue")) == target:
            return "rejected" not in seen
    return False


def first_tier(plan: Plan, queue: str) -> Binding | None:
    """The binding that takes ``queue``'s broker dead letters (routing key ``queue`` on
    ``Q.retry``) to its first tier; None when the file sends them elsewhere."""
    tiers = {q.name for q in plan.queues_of(queue) if q.role == "tier"}
    return next((b for b in plan.bindings if b.source == naming.retry_exchange(queue)
                 and b.routing_key == queue and b.destination in tiers), None)


@dataclass(frozen=True)
class Work:
    """One main queue to rescue: how many the broker holds in it, and whether an earlier run
    left ``Q.rescue`` behind (its messages are picked up)."""

    queue: str
    tier: Binding
    stranded: int
    leftover: bool = False

    @property
    def rescue(self) -> str:
        return naming.rescue_queue(self.queue)

    @property
    def line(self) -> str:
        what = f"{self.queue}: {plural(self.stranded, 'message')} stranded by RabbitMQ's " \
               "dead-letter cycle check"
        if self.leftover:
            what += f", and what {self.rescue} holds from an earlier run"
        return (f"{what}: to {naming.parking_queue(self.queue)}, through {self.rescue}; "
                f"{naming.retry_exchange(self.queue)}'s bindings change for up to two of the "
                "broker's dead-letter retry intervals")


@dataclass(frozen=True)
class Survey:
    work: tuple[Work, ...] = ()
    cannot: tuple[str, ...] = ()  # one line per queue whose stranded messages cannot be moved


def cannot_line(tier: str, count: int, queue: str) -> str:
    """Why the messages stranded in a tier of ``queue`` stay there."""
    return (f"{tier}: {plural(count, 'message')} stranded by RabbitMQ's dead-letter cycle check "
            "cannot be moved: a tier dead-letters to the default exchange with routing key "
            f"{queue!r}, whose only route is {queue!r}, the cycle the broker refuses, and its "
            "queue arguments win over any policy; they stay held (do not purge or delete it: "
            "that deletes them)")


def survey(status: Status, plan: Plan, leftovers: Iterable[str],
           queues: Sequence[str] = ()) -> Survey:
    """What ``rescue`` would do for the main queues of ``status`` (those of ``queues``, when
    given): ``leftovers`` are the queues whose ``Q.rescue`` of ours exists."""
    left = set(leftovers)
    work: list[Work] = []
    cannot: list[str] = []
    for row in status.queues:
        if queues and row.queue not in queues:
            continue
        cannot.extend(cannot_line(name, count, row.queue) for name, count in row.held
                      if name in row.stranded and name != row.queue)
        item = _work_of(row, plan, row.queue in left)
        if isinstance(item, str):
            cannot.append(item)
        elif item is not None:
            work.append(item)
    return Survey(tuple(work), tuple(cannot))


def read_survey(api: Management, settings: Settings, plan: Plan, file: str,
                queues: Sequence[str], on_park: Mapping[str, str]) -> Survey:
    """``survey`` of the broker now (``status``'s own reading, one source of truth)."""
    report = read_status(api, settings, plan, file, on_park)
    leftovers = [q.name for q in plan.main_queues
                 if (api.queue(settings.vhost, naming.rescue_queue(q.name)) or {})
                 .get("arguments", {}).get(RESCUE_OF) == q.name]
    return survey(report, plan, leftovers, queues)


def _work_of(row: QueueStatus, plan: Plan, leftover: bool) -> Work | str | None:
    stranded = dict(row.held).get(row.queue, 0) if row.queue in row.stranded else 0
    if not stranded and not leftover:
        return None
    tier = first_tier(plan, row.queue)
    if tier is None:  # nothing of the file's routes a dead letter of Q back to Q
        return (f"{row.queue}: {plural(stranded, 'message')} held for dead-lettering, and its "
                "file routes no dead letter to a tier: not a cycle rescue can break")
    down = [r for r in row.replicas if r.offline and r.queue in (row.queue, tier.destination)]
    if down:
        # A copy of a nack meanwhile is dropped because the tier has it: only when it confirms.
        return (f"{row.queue}: not rescued while a replica of {down[0].queue} is offline "
                f"({', '.join(down[0].offline)}): the tier must confirm what {row.queue} "
                "dead-letters meanwhile; run rescue again once it is online")
    return Work(row.queue, tier, stranded, leftover)


def parked_copy_headers(headers: Mapping[str, Any] | None, queue: str, *, now: datetime,
                        expiration: str | None = None) -> dict[str, Any]:
    """The headers of a stranded message's copy in ``Q.parking``, as the worker parks: reason
    ``stranded``, failed attempts so far, where it was first published, why."""
    past = history.read(headers, False, "", queue, queue, ours=True)
    failure = copies.Failure(
        type=STRANDED_FAILURE,
        message=f"reached {queue!r}'s delivery limit without a verdict from the worker and was "
        "held by RabbitMQ's dead-letter cycle check (last death: "
        f"{_last_reason(headers)}); parked by rabbit-retry rescue, the handler was not called",
        stacktrace="",
    )
    return copies.parked_headers(
        headers, reason=PARKED_REASON, retry_count=past.failures, queue=queue,
        original=past.source or ("", queue), failure=failure, now=now,
        parked_id=new_message_id(), expiration=expiration or past.moved_expiration,
    )


def _last_reason(headers: Mapping[str, Any] | None) -> str:
    deaths = (headers or {}).get(X_DEATH)
    if isinstance(deaths, list | tuple) and deaths and isinstance(deaths[0], Mapping):
        return as_text(deaths[0].get("reason")) or "-"
    return "-"


def done_waiting_for_copies(held: int, in_queue: int) -> bool:
    """Step 1 is over when ``Q.rescue`` gave us as many stranded messages as ``Q`` holds."""
    return held >= in_queue and (held > 0 or in_queue == 0)


def let_go(in_queue: int, highest: int, held: int) -> bool:
    """Step 2 is over when ``Q`` holds ``held`` fewer than the most it held since it began (a
    ``nack`` meanwhile adds one it keeps)."""
    return in_queue <= max(0, highest - held)


# --- on the broker ------------------------------------------------------------------------------


@dataclass
class Outcome:
    queue: str
    parked: int = 0
    dropped: int = 0  # copies of messages that are in the tier
    left: int = 0  # still stranded in Q when it ended (stranded meanwhile): run again

    def lines(self, file: str) -> list[str]:
        copies = "copy" if self.dropped == 1 else "copies"
        lines = [f"{self.queue}: parked {plural(self.parked, 'stranded message')} in "
                 f"{naming.parking_queue(self.queue)} (reason {PARKED_REASON}), dropped "
                 f"{self.dropped} {copies} of messages in its tier; "
                 f"{naming.retry_exchange(self.queue)}'s bindings as {file} has them"]
        if self.left:
            lines.append(f"{self.queue}: {self.left} held there now (stranded meanwhile?): run "
                         "rescue again")
        return lines


@dataclass
class _Held:
    tag: int
    body: bytes
    properties: spec.Basic.Properties


@dataclass
class _Run:
    """One queue's rescue on one channel (publisher confirms)."""

    channel: AbstractChannel
    api: Management
    settings: Settings
    work: Work
    interval: float
    say: Say
    held: list[_Held] = field(default_factory=list)
    outcome: Outcome | None = None

    @property
    def queue(self) -> str:
        return self.work.queue

    async def bind(self, queue: str, bound: bool) -> None:
        tier = self.work.tier
        exchange = naming.retry_exchange(self.queue)
        if bound:
            await self.channel.queue_bind(queue, exchange, routing_key=self.queue,
                                          arguments=dict(tier.arguments) if queue ==
                                          tier.destination else None)
        else:
            await self.channel.queue_unbind(queue, exchange, routing_key=self.queue,
                                            arguments=dict(tier.arguments) if queue ==
                                            tier.destination else None)

    def in_queue(self) -> int:
        """What ``Q`` holds for dead-lettering (the management API's count, seconds old)."""
        found = self.api.queue(self.settings.vhost, self.queue) or {}
        return int(found.get("messages_dlx") or 0)

    async def take(self, outcome: Outcome) -> None:
        """Everything ``Q.rescue`` holds now: stranded ones kept unacked, copies dropped."""
        while True:
            got = await self.channel.basic_get(self.work.rescue, no_ack=False)
            if not isinstance(got.delivery, spec.Basic.GetOk):
                return
            tag = got.delivery.delivery_tag
            assert tag is not None
            properties = got.header.properties
            if is_dead_letter_cycle(self.work.tier.destination,
                                    (properties.headers or {}).get(X_DEATH)):
                self.held.append(_Held(tag, got.body or b"", properties))
            else:
                await self.channel.basic_ack(tag)
                outcome.dropped += 1

    async def wait(self, what: str, done: Callable[[], bool], outcome: Outcome) -> None:
        """Polls ``done`` (taking what ``Q.rescue`` receives) until it holds, one interval and
        some slack at most; says how it goes now and then."""
        started = last = time.monotonic()
        while True:
            await self.take(outcome)
            if done():
                return
            now = time.monotonic()
            if now - started > self.interval + SLACK_S:
                raise BrokerError(
                    f"{self.queue}: the broker did not {what} within {self.interval + SLACK_S:.0f}"
                    "s (is its dead_letter_worker_publisher_confirm_timeout longer than "
                    "--interval?); bindings put back, what it moved stays in "
                    f"{self.work.rescue}: run rescue again")
            if now - last >= PROGRESS_EVERY_S:
                last = now
                self.say(f"{self.queue}: waiting for the broker to {what} (it tries every "
                         f"{self.interval:.0f}s): {plural(len(self.held), 'message')} in "
                         f"{self.work.rescue}, {self.in_queue()} held in {self.queue}, "
                         f"{now - started:.0f}s so far")
            await asyncio.sleep(POLL_S)

    async def park(self, outcome: Outcome) -> None:
        parking = naming.parking_queue(self.queue)
        for item in list(self.held):
            props = item.properties
            headers = parked_copy_headers(props.headers, self.queue, now=datetime.now(UTC),
                                          expiration=props.expiration)
            properties = republish_properties(props, headers, self.settings.user,
                                              expiration=None)
            try:
                await self.channel.basic_publish(item.body, exchange="", routing_key=parking,
                                                 properties=properties, mandatory=True,
                                                 timeout=PUBLISH_TIMEOUT_S)
            except (aiormq.exceptions.PublishError, aiormq.exceptions.DeliveryError,
                    TimeoutError) as exc:
                raise BrokerError(f"{parking} did not take a stranded message of {self.queue} "
                                  f"({type(exc).__name__}); it stays in {self.work.rescue}: "
                                  "run rescue again") from None
            await self.channel.basic_ack(item.tag)
            self.held.remove(item)
            outcome.parked += 1

    async def run(self) -> Outcome:
        outcome = Outcome(self.queue)
        await self.bind(self.work.rescue, True)
        await self.bind(self.work.tier.destination, True)
        await self.wait("send the stranded messages on",
                        lambda: done_waiting_for_copies(len(self.held), self.in_queue()), outcome)
        highest = self.in_queue()
        if highest:
            await self.bind(self.work.rescue, False)
            await self.bind(self.work.tier.destination, False)
            count = len(self.held)
            self.say(f"{self.queue}: {plural(count, 'stranded message')} in {self.work.rescue}; "
                     f"{self.work.tier.destination} unbound from "
                     f"{naming.retry_exchange(self.queue)} until the broker lets go of them in "
                     f"{self.queue} (at its next try)")

            def gone() -> bool:
                nonlocal highest
                now = self.in_queue()
                highest = max(highest, now)
                return let_go(now, highest, count)

            await self.wait(f"let go of them in {self.queue}", gone, outcome)
        await self.restore()
        await self.park(outcome)
        await self.take(outcome)  # nothing is bound to it now: what came after step 1's look
        await self.park(outcome)
        # Quorum queues refuse if-empty; nothing is bound to it any more, and we hold nothing.
        ok = await self.channel.queue_declare(self.work.rescue, passive=True)
        if not ok.message_count:
            await self.channel.queue_delete(self.work.rescue)
        outcome.left = self.in_queue()
        return outcome

    async def restore(self) -> None:
        """The file's bindings: the first tier bound, ``Q.rescue`` not."""
        await self.bind(self.work.tier.destination, True)
        await self.bind(self.work.rescue, False)


async def _declare_rescue(channel: AbstractChannel, work: Work) -> None:
    """``Q.rescue``: a quorum queue (it survives a restart), with a delivery limit no look of
    ours reaches, marked as ours; another queue of that name is refused."""
    arguments: dict[str, Any] = {"x-queue-type": "quorum",
                                 "x-delivery-limit": PARKING_DELIVERY_LIMIT, RESCUE_OF: work.queue}
    try:
        await channel.queue_declare(work.rescue, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed:
        raise ConflictError(f"{work.queue}: a queue {work.rescue!r} that rabbit-retry did not "
                            "make exists; rescue needs that name (rename or delete it)") from None


async def rescue_queue(settings: Settings, api: Management, work: Work, interval: float,
                       say: Say) -> Outcome:
    """Rescue ``work``'s queue; on any way out but success (an error, Ctrl-C, SIGTERM, a lost
    connection), bindings are put back as the file has them where the broker can still be
    reached, and what ``Q.rescue`` holds stays there for the next run."""
    try:
        connection = await connect(settings, name="rabbit-retry rescue")
    except CONNECTION_ERRORS as exc:
        raise BrokerError(f"broker at {settings.safe_url} failed: {mask(str(exc))}") from exc
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    with suppress(NotImplementedError, RuntimeError):  # not on Windows, nor off the main thread
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        declaring = await connection.channel()
        await _declare_rescue(await declaring.get_underlay_channel(), work)
        run = _Run(await channel.get_underlay_channel(), api, settings, work, interval, say)
        try:
            return await run.run()
        except BaseException:
            say(await _stopped(run, connection))
            raise
    except aiormq.exceptions.AMQPError as exc:
        raise BrokerError(f"{work.queue}: broker at {settings.safe_url} failed: "
                          f"{mask(str(exc))}; run rescue again to finish") from exc
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # SIGTERM: said as Ctrl-C is
    finally:
        with suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)
        with suppress(Exception):
            await connection.close()


async def _stopped(run: _Run, connection: AbstractConnection) -> str:
    """Puts the file's bindings back; what to tell the operator of a run that stopped."""
    work = run.work
    waiting = (f"{plural(len(run.held), 'stranded message')} wait in {work.rescue} (with what it "
               "held before)") if run.held else f"what {work.rescue} holds stays there"
    try:
        # On a channel of its own: a Ctrl-C cancels the call under way, and aiormq closes the
        # channel of a cancelled call (it refuses every call at once, before the broker has
        # answered the close).
        run.channel = await (await connection.channel()).get_underlay_channel()
        await run.restore()
    except Exception as exc:
        return (f"{work.queue}: stopped, and {naming.retry_exchange(work.queue)}'s bindings could "
                f"not be put back ({mask(str(exc)) or type(exc).__name__}); {waiting}: run "
                "rescue again, it puts them back and finishes")
    return (f"{work.queue}: stopped; {naming.retry_exchange(work.queue)}'s bindings are as the "
            f"file has them; {waiting}: run rescue again to finish")
