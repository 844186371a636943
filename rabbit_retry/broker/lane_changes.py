"""Giving a live ordered queue more lanes, or fewer (``rabbit-retry migrate``), without breaking
any key's order.

The lanes exchange numbers its buckets in the order its lanes were bound and spreads keys over
them by jump consistent hashing, so binding one more lane moves keys only to the new one: each
moved key may still have earlier messages in an old lane (queued, or held there). AMQP has no
way to bind several queues at once, so while lanes ``N..M-1`` are bound one after another a key
may also move from one new lane to a later one. So, for each change from ``N`` to ``M`` lanes
(``worker/ordering.py`` has the entries, ``worker/ordered.py`` what a lane does with them):

1. ``mark``: declare the empty queue ``Q.lanes.N-to-M`` (it says a change is under way until
   the last step; run again, ``migrate`` finishes what it finds);
2. ``gate``: for each new lane ``j``, declare its held queue and write a *gate* into it naming
   the lanes ``0..j-1``, then declare the lane (a worker that takes it reads the gate first): it
   runs nothing until each of those lanes has said it passed;
3. ``bind``: bind the new lanes to ``Q.lanes`` in order: from here on their keys go to them;
4. ``fence``: publish a *fence* into each lane but the last, naming the new lanes after it:
   everything before the fence in a lane was routed before its keys could move. A lane's worker
   settles what came before it, waits until none of the keys it held (or kept messages of)
   then is held any more, and sends *passed* to those lanes;
5. ``unmark``: delete ``Q.lanes.N-to-M``.

Every step is idempotent: a gate is written only while its lane is not declared, a binding only
when missing, and a fence or passed entry twice counts once.

Fewer lanes, from ``N`` to ``M`` (RabbitMQ 4.3 and later, for a lanes exchange ``apply`` marked
as bound in lane order: the exchange keeps its buckets in the order the lanes were bound, through
restarts too, so unbinding the last lane moves only its keys), one lane at a time,
the last first, each once the one after it is done (the keys of a lane unbound while a later
removed lane was still bound would partly go to that one, which hands over its own keys: a key
could then wait on two lanes at once). For lane ``r`` (the last one on the broker):

1. ``mark``: declare ``Q.lanes.<r+1>-to-<r>`` (it stays until lane ``r`` is deleted);
2. ``gate``: while ``r`` is still bound, publish a *gate* into each lane before it, naming
   ``r``: from there on the lane moves every delivery to its held queue until ``r`` passed;
3. ``unbind``: unbind ``r`` from ``Q.lanes``: its keys go to the lanes before it, behind the
   gates;
4. ``fence``: publish a *fence* into ``r``, naming the lanes before it, and then one message
   into the marker (the fence is out). Lane ``r``'s worker settles what came before its fence,
   passes at once, handing over the keys it still holds (the other lanes hold them), goes on
   with those keys and releases each once it is free, and then puts a ``fenced`` message naming
   itself into the marker;
5. ``delete``: once that message is there (a run waits ``DRAIN_WAIT`` for it), declare the
   next step's marker (if a lane is still to go), delete ``r`` with its held queue, then this
   step's marker. A lane still busy (a key held by a parked message) stops the run there; the next
   run goes on from it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiormq.abc import AbstractChannel
from pamqp import commands as spec

from rabbit_retry.broker.diff import Change
from rabbit_retry.broker.migrate import TIMEOUT, MigrationRun, Say, finish_later, migration_run
from rabbit_retry.contract import ORDERED_ENTRY, ORDERED_LANES, as_text, new_message_id
from rabbit_retry.held import Entry, change_id, read_lanes
from rabbit_retry.settings import Settings
from rabbit_retry.text import numbered
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Plan, Queue


@dataclass(frozen=True)
class LaneChange:
    """Ordered queue ``queue`` from ``before`` lanes to ``after``, with the file's new lanes,
    their held queues and their bindings to the lanes exchange (in lane order)."""

    queue: str
    before: int
    after: int
    lanes: tuple[Queue, ...]
    held: tuple[Queue, ...]
    bindings: tuple[Binding, ...]

    @property
    def marker(self) -> str:
        return naming.lanes_change_queue(self.queue, self.before, self.after)

    @property
    def id(self) -> str:
        return change_id(self.before, self.after)


def plan_lane_changes(changes: Sequence[Change], plan: Plan) -> list[LaneChange]:
    """The lane changes ``changes`` (``diff``) hold; pure."""
    out = []
    for change in changes:
        if change.kind != "migrate" or change.lanes is None:
            continue
        before, after = change.lanes
        queues = {q.name: q for q in plan.queues_of(change.name)}
        new = range(before, after)
        lanes = tuple(queues[naming.lane_queue(change.name, n)] for n in new)
        held = tuple(queues[naming.held_queue(change.name, n)] for n in new)
        bindings = tuple(next(b for b in plan.bindings if b.destination == lane.name)
                         for lane in lanes)
        out.append(LaneChange(change.name, before, after, lanes, held, bindings))
    return out


def describe(change: LaneChange, held: tuple[int, int] = (0, 0)) -> list[str]:
    """What ``migrate`` will do for one lane change, one line per step; ``held``: the queue's
    held keys now, and how many of them parked messages hold."""
    if change.after < change.before:
        return _describe_removal(change, held)
    new = ", ".join(lane.name for lane in change.lanes)
    keys, parked = held
    now = [] if not keys else [
        f"  held now      keys held: {keys}, by parked messages: {parked}"
        + (" (replay or discard those)" if parked else "") + "; a lane passes once no key it "
        "holds is held, and keys moving from it wait until then"]
    return [
        f"queue {change.queue}: from {change.before} lanes to {change.after}",
        *now,
        f"  mark          declare {change.marker} (a change under way; run migrate again to "
        "finish it)",
        f"  gate          declare {new} and their held queues, each shut until the lanes "
        "before it pass",
        f"  bind          bind them to {naming.lanes_exchange(change.queue)}: the keys they take "
        "go to them from here on",
        "  fence         a fence into each lane but the last: its worker passes once what came "
        "before it is done and no key it held then is held",
        f"  unmark        delete {change.marker}",
    ]


def _describe_removal(change: LaneChange, held: tuple[int, int]) -> list[str]:
    keys, parked = held
    now = [] if not keys else [
        f"  held now      keys held: {keys}, by parked messages: {parked}; a removed lane hands "
        "its held keys over, they wait in the lanes before it until it is done with them, and "
        "it is deleted then (a parked one: once replayed or discarded)"]
    marker = f"{naming.lanes_exchange(change.queue)}.<r+1>-to-<r>"
    return [
        f"queue {change.queue}: from {change.before} lanes to {change.after}, taking away "
        f"{numbered('lane', change.after, change.before)} one at a time, the last first; "
        "for each lane r:",
        *now,
        f"  mark          declare {marker} (a change under way; run migrate again to finish "
        "it)",
        "  gate          a gate into the lanes before r: each moves what comes after it to its "
        "held queue until r passed",
        f"  unbind        unbind r from {naming.lanes_exchange(change.queue)}: its keys go to "
        "the lanes before it from here on",
        "  fence         a fence into r: it passes once what came before it is done, handing "
        "over the keys it still holds",
        f"  delete        delete r and its held queue once it is done with its keys (waits up "
        f"to {DRAIN_WAIT:g}s; else the next run goes on from r), then the marker",
    ]


async def change_lanes(
    settings: Settings, changes: Sequence[LaneChange], say: Say = lambda _: None
) -> None:
    """Carry out every lane change (the module's steps), in order."""
    async with migration_run(settings, say) as run:
        for change in changes:
            if change.after < change.before:
                with finish_later(f"taking lanes away from {change.queue}"):
                    await _remove(run, change)
            else:
                with finish_later(f"adding lanes to {change.queue}"):
                    await _add(run, change)


async def _entry(channel: AbstractChannel, queue: str, headers: dict[str, Any]) -> None:
    """One entry (a gate, a fence, a marker's message) straight into ``queue``, confirmed."""
    await channel.basic_publish(
        b"", exchange="", routing_key=queue, mandatory=True, timeout=TIMEOUT,
        properties=spec.Basic.Properties(headers=headers, delivery_mode=2,
                                         message_id=new_message_id(), app_id="rabbit-retry"))


async def _add(run: MigrationRun, change: LaneChange) -> None:
    channel = await run.channel(confirms=True)
    exchange = naming.lanes_exchange(change.queue)

    async def declare(queue: Queue) -> None:
        await channel.queue_declare(queue.name, durable=queue.durable,
                                    arguments=dict(queue.arguments), timeout=TIMEOUT)

    async def entry(queue: str, written: Entry) -> None:
        await _entry(channel, queue, written.headers())

    await channel.queue_declare(change.marker, durable=True,
                                arguments={"x-queue-type": "classic"}, timeout=TIMEOUT)
    run.say(f"{change.queue}: declared {change.marker} (a change of lanes under way)")
    for number, lane, held in zip(range(change.before, change.after), change.lanes,
                                  change.held, strict=True):
        if await run.count(lane.name) is not None:
            continue  # declared by an earlier run, after its gate
        await declare(held)
        await entry(held.name, Entry("gate", "", 0, change.id, lanes=tuple(range(number))))
        await declare(lane)
        shut = numbered("lane", 0, number)
        run.say(f"{change.queue}: declared {lane.name}, shut until {shut} pass")
    for binding in change.bindings:
        if not any(b.source == exchange for b in run.bindings_to(binding.destination)):
            await channel.queue_bind(binding.destination, exchange,
                                     routing_key=binding.routing_key,
                                     arguments=dict(binding.arguments), timeout=TIMEOUT)
            run.say(f"{change.queue}: bound {binding.destination} to {exchange}")
    for number in range(change.after - 1):
        targets = tuple(range(max(change.before, number + 1), change.after))
        await entry(naming.lane_queue(change.queue, number),
                    Entry("fence", "", 0, change.id, lanes=targets))
    fenced = numbered("lane", 0, change.after - 1)
    run.say(f"{change.queue}: a fence in {fenced}; each passes once what came before it is done")
    await channel.queue_delete(change.marker, timeout=TIMEOUT)
    await channel.close()
    run.say(f"{change.queue}: {change.after} lanes; the new ones run once every lane before "
            "them passed (a worker that consumes them reads the topology with "
            f"{change.after} lanes)")


# How long a run waits for the removed lanes to say they are done before it leaves them to the
# next run (a lane that holds no key is done as soon as its worker reached the fence).
DRAIN_WAIT = 15.0
FENCES_OUT = "fence"  # the marker's message that says the fences are out


async def _remove(run: MigrationRun, change: LaneChange) -> None:
    """Take the last lanes away one at a time, each once the one after it is done (keys of a
    lane unbound while a later removed lane is still bound would go to that one, whose own
    keys it hands over: a key could then wait on two lanes at once)."""
    # A step's marker a run left beside the next one's (its lane is gone)
    await _delete(run, naming.lanes_change_queue(change.queue, change.before + 1, change.before))
    for lanes in range(change.before, change.after, -1):
        step = LaneChange(change.queue, lanes, lanes - 1, (), (), ())
        if not await _remove_last(run, step, last=lanes - 1 == change.after):
            lane = naming.lane_queue(change.queue, lanes - 1)
            counted = await run.count(lane)
            why = (f"nobody consumes {lane}: the lanes before it run nothing until it passes; "
                   f"start a worker (on this file, or the one of {change.before} lanes)"
                   if counted is not None and counted[1] == 0 else
                   f"lane {lanes - 1} still holds keys (a parked message holds its key until "
                   "it is replayed or discarded: status, the desk's Held keys); their keys "
                   "wait in the remaining lanes")
            run.say(f"{change.queue}: {why}. Run migrate again to go on once it is done "
                    f"({numbered('lane', change.after, lanes)} to take away)")
            return
    run.say(f"{change.queue}: {change.after} lanes")


async def _remove_last(run: MigrationRun, step: LaneChange, *, last: bool) -> bool:
    """Take lane ``step.after`` (the last) away; whether it is done and deleted."""
    channel = await run.channel(confirms=True)
    exchange = naming.lanes_exchange(step.queue)
    number = step.after
    lane = naming.lane_queue(step.queue, number)
    if await run.count(step.marker) is None:
        await channel.queue_declare(step.marker, durable=True,
                                    arguments={"x-queue-type": "classic"}, timeout=TIMEOUT)
        run.say(f"{step.queue}: declared {step.marker} (a change of lanes under way)")
    if FENCES_OUT not in await _marked(run, step.marker):
        bound = [b for b in run.bindings_to(lane) if b.source == exchange]
        if bound:  # not unbound yet: the gates go first
            gate = Entry("gate", "", 0, step.id, lanes=(number,)).headers()
            for other in range(number):
                await _entry(channel, naming.lane_queue(step.queue, other), gate)
            run.say(f"{step.queue}: a gate in {numbered('lane', 0, number)}: they run nothing "
                    f"until lane {number} passes")
        for binding in bound:
            await channel.queue_unbind(lane, exchange, routing_key=binding.routing_key,
                                       arguments=dict(binding.arguments), timeout=TIMEOUT)
            run.say(f"{step.queue}: unbound {lane} from {exchange}")
        fence = Entry("fence", "", 0, step.id, lanes=tuple(range(number))).headers()
        await _entry(channel, lane, fence)
        await _entry(channel, step.marker, {ORDERED_ENTRY: FENCES_OUT})
        run.say(f"{step.queue}: a fence in {lane}; it passes once what came before it is done, "
                "handing over the keys it holds")
    await channel.close()
    if not await _done(run, step.marker, number):
        return False
    if not last:
        # The next step's marker before this lane goes: a worker on the new file that
        # (re)connects in between must find a marker for every lane past its file, or it
        # would not consume the next lane to go, and the gates would shut every lane.
        following = naming.lanes_change_queue(step.queue, number, number - 1)
        channel = await run.channel()
        await channel.queue_declare(following, durable=True,
                                    arguments={"x-queue-type": "classic"}, timeout=TIMEOUT)
        await channel.close()
    await _delete(run, naming.held_queue(step.queue, number), lane)
    run.say(f"{step.queue}: deleted {lane} and its held queue (done)")
    await _delete(run, step.marker)
    return True


async def _done(run: MigrationRun, marker: str, lane: int) -> bool:
    """Whether removed lane ``lane`` said it is done, waiting up to ``DRAIN_WAIT``."""
    until = time.monotonic() + DRAIN_WAIT
    while str(lane) not in await _marked(run, marker):
        if time.monotonic() > until:
            return False
        await asyncio.sleep(0.5)
    return True


async def _delete(run: MigrationRun, *queues: str) -> None:
    channel = await run.channel()
    for queue in queues:
        await channel.queue_delete(queue, timeout=TIMEOUT)
    await channel.close()


async def _marked(run: MigrationRun, marker: str) -> set[str]:
    """What the marker's messages say: the fences are out (``FENCES_OUT``), and the removed
    lanes that are done (their numbers). Each is taken unacked and given back as the channel
    closes."""
    channel = await run.channel()
    said: set[str] = set()
    try:
        while True:
            message = await channel.basic_get(marker, no_ack=False, timeout=TIMEOUT)
            if not isinstance(message.delivery, spec.Basic.GetOk):
                return said
            headers = message.header.properties.headers or {}
            if as_text(headers.get(ORDERED_ENTRY)) == FENCES_OUT:
                said.add(FENCES_OUT)
            elif (lanes := read_lanes(headers.get(ORDERED_LANES))) is not None:
                said.update(map(str, lanes))
    finally:
        await channel.close()
