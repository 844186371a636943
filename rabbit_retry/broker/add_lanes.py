"""Giving a live ordered queue more lanes (``rabbit-retry migrate``) without breaking any key's
order.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pamqp import commands as spec

from rabbit_retry.broker.diff import Change
from rabbit_retry.broker.migrate import TIMEOUT, MigrationRun, Say, finish_later, migration_run
from rabbit_retry.contract import new_message_id
from rabbit_retry.held import Entry, change_id
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


async def add_lanes(
    settings: Settings, changes: Sequence[LaneChange], say: Say = lambda _: None
) -> None:
    """Carry out every lane change (the module's steps), in order."""
    async with migration_run(settings, say) as run:
        for change in changes:
            with finish_later(f"adding lanes to {change.queue}"):
                await _add(run, change)


async def _add(run: MigrationRun, change: LaneChange) -> None:
    channel = await run.channel(confirms=True)
    exchange = naming.lanes_exchange(change.queue)

    async def declare(queue: Queue) -> None:
        await channel.queue_declare(queue.name, durable=queue.durable,
                                    arguments=dict(queue.arguments), timeout=TIMEOUT)

    async def entry(queue: str, written: Entry) -> None:
        await channel.basic_publish(
            b"", exchange="", routing_key=queue, mandatory=True, timeout=TIMEOUT,
            properties=spec.Basic.Properties(headers=written.headers(), delivery_mode=2,
                                             message_id=new_message_id(),
                                             app_id="rabbit-retry"))

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
