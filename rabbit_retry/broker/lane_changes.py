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

Fewer lanes, from ``N`` to ``M`` (RabbitMQ 4.3 and later: the exchange keeps its buckets in the
order the lanes were bound, so unbinding the last lanes moves only their keys):

1. ``mark``: declare ``Q.lanes.N-to-M`` (it stays until the removed lanes are deleted);
2. ``gate``: while every removed lane is still bound, publish a *gate* into each remaining lane,
   naming the removed ones: from there on the lane moves every delivery to its held queue
   until each removed lane has passed;
3. ``unbind``: unbind the removed lanes from ``Q.lanes``, the last first: their keys go to the
   remaining lanes, behind the gates;
4. ``fence``: publish a *fence* into each removed lane, naming the remaining ones, and then one
   message into the marker (the fences are out). A removed lane's worker settles what came
   before its fence, passes at once, handing over the keys it still holds (the remaining lanes
   hold them), goes on with those keys and releases each once it is free, and then puts a
   ``fenced`` message naming itself into the marker;
5. ``delete``: each removed lane whose ``fenced`` is in the marker and which holds nothing is
   deleted with its held queue; the marker goes with the last. A lane still busy (a key held by
   a parked message) is left for the next run.
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
    gone = numbered("lane", change.after, change.before)
    rest = numbered("lane", 0, change.after)
    keys, parked = held
    now = [] if not keys else [
        f"  held now      keys held: {keys}, by parked messages: {parked}; a removed lane hands "
        "its held keys over, they wait in the remaining lanes until it is done with them, and "
        "it is deleted then (a parked one: once replayed or discarded)"]
    return [
        f"queue {change.queue}: from {change.before} lanes to {change.after}",
        *now,
        f"  mark          declare {change.marker} (a change under way; run migrate again to "
        "finish it)",
        f"  gate          a gate into {rest}: each moves what comes after it to its held queue "
        f"until {gone} passed",
        f"  unbind        unbind {gone} from {naming.lanes_exchange(change.queue)}, the last "
        "first: their keys go to the remaining lanes from here on",
        f"  fence         a fence into {gone}: each passes once what came before it is done, "
        "handing over the keys it still holds",
        f"  delete        delete {gone} and their held queues once each is done with its keys "
        f"(waits up to {DRAIN_WAIT:g}s; the next run deletes the rest), then {change.marker}",
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
    channel = await run.channel(confirms=True)
    exchange = naming.lanes_exchange(change.queue)
    removed = range(change.after, change.before)
    remaining = tuple(range(change.after))
    if await run.count(change.marker) is None:
        await channel.queue_declare(change.marker, durable=True,
                                    arguments={"x-queue-type": "classic"}, timeout=TIMEOUT)
        run.say(f"{change.queue}: declared {change.marker} (a change of lanes under way)")
    if FENCES_OUT not in await _marked(run, change.marker):
        bound = {n: [b for b in run.bindings_to(naming.lane_queue(change.queue, n))
                     if b.source == exchange] for n in removed}
        if all(bound.values()):  # nothing unbound yet: the gates go first
            gate = Entry("gate", "", 0, change.id, lanes=tuple(removed)).headers()
            for lane in remaining:
                await _entry(channel, naming.lane_queue(change.queue, lane), gate)
            run.say(f"{change.queue}: a gate in {numbered('lane', 0, change.after)}: they run "
                    f"nothing until {numbered('lane', change.after, change.before)} pass")
        for n in reversed(removed):
            for binding in bound[n]:
                await channel.queue_unbind(binding.destination, exchange,
                                           routing_key=binding.routing_key,
                                           arguments=dict(binding.arguments), timeout=TIMEOUT)
                run.say(f"{change.queue}: unbound {binding.destination} from {exchange}")
        fence = Entry("fence", "", 0, change.id, lanes=remaining).headers()
        for n in removed:
            await _entry(channel, naming.lane_queue(change.queue, n), fence)
        await _entry(channel, change.marker, {ORDERED_ENTRY: FENCES_OUT})
        run.say(f"{change.queue}: a fence in {numbered('lane', change.after, change.before)}; "
                "each passes once what came before it is done, handing over the keys it holds")
    await channel.close()
    left = await _delete_drained(run, change)
    if left:
        run.say(f"{change.queue}: {numbered('lane', min(left), max(left) + 1)} still "
                "hold keys (a parked message holds its key until it is replayed or discarded: "
                "status, the desk's Held keys); their keys wait in the remaining lanes. Run "
                "migrate again to delete them once they are done")
        return
    await _delete(run, change.marker)
    run.say(f"{change.queue}: {change.after} lanes; {change.marker} deleted")


async def _delete_drained(run: MigrationRun, change: LaneChange) -> list[int]:
    """Delete each removed lane that said it is done and holds nothing; the lanes left."""
    left = list(range(change.after, change.before))
    until = time.monotonic() + DRAIN_WAIT
    while True:
        done = await _marked(run, change.marker)
        for n in list(left):
            lane, held = naming.lane_queue(change.queue, n), naming.held_queue(change.queue, n)
            if str(n) not in done:
                continue
            if [q for q in (lane, held) if (await run.count(q) or (0, 0))[0]]:
                continue  # a late copy: its worker takes it
            await _delete(run, held, lane)
            run.say(f"{change.queue}: deleted {lane} and {held} (done)")
            left.remove(n)
        if not left or time.monotonic() > until:
            return left
        await asyncio.sleep(0.5)


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
