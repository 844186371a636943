"""Migrating a queue the broker will not change in place, as pure decisions: which queues need
it, what the holding queue is, which step a (possibly interrupted) migration is at, and which
moved message is a copy of one already moved.

A queue cannot be renamed, so migrating queue ``X`` to its new definition goes through a
holding queue ``X.migrating`` that exists only while the migration runs:

1. ``hold``: declare ``X.migrating``, a plain classic queue (no TTL, no limit, no
   dead-lettering: nothing in it expires or is dropped while it waits; looking at it with
   ``basic.get`` and giving the messages back changes nothing, as with a parking queue);
2. ``route-to-hold``: bind ``X.migrating`` like ``X``, then unbind ``X``: from this moment a
   publish through any of ``X``'s bindings lands in the holding queue, never nowhere;
3. ``drain``: move ``X``'s messages into the holding queue, each copy confirmed before the
   original is acked, skipping a message the holding queue already holds (same message id and
   body: routed to both in the instant between bind and unbind, or moved by a run that was
   killed before its ack);
4. ``release``: close the connections consuming ``X`` (their unacked messages return to it and
   are drained), then delete ``X`` once the broker counts it empty and unused;
5. ``redeclare``: declare ``X`` with the file's definition;
6. ``route-back``: bind ``X`` like the holding queue, put a marker message into the holding
   queue, unbind it: what follows the marker was routed to ``X`` too;
7. ``refill``: move each held message before the marker into ``X`` (confirmed, then acked),
   drop what follows it, delete the holding queue once the broker counts it empty.

Every step is idempotent, and which one to resume at is read from the broker (``stage``): a
migration killed at any point is finished by running ``migrate`` again. A main queue's tiers
run their first three steps before it is rebuilt and the rest after (``schedule``).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rabbit_retry.broker.diff import Change, group_queues, queue_differences
from rabbit_retry.broker.inspect import LivePolicy, LiveState
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Queue

# The header of the marker message ``route-back`` puts into the holding queue.
MARKER_HEADER = "x-rabbit-retry-migration"
MARKER_VALUE = "routed-back"
# Broker annotations a moved copy must not carry: they count deliveries of the original.
ANNOTATIONS = ("x-delivery-count", "x-acquired-count")

Step = Literal["hold", "route-to-hold", "drain", "release", "redeclare", "route-back", "refill"]
STEPS: tuple[Step, ...] = (
    "hold", "route-to-hold", "drain", "release", "redeclare", "route-back", "refill"
)


hold_queue = naming.migrating_queue


def hold_arguments() -> dict[str, Any]:
    """The holding queue's arguments (see the module's first step)."""
    return {"x-queue-type": "classic"}


@dataclass(frozen=True)
class Seen:
    """What the broker shows of one migration: the queue and its holding queue."""

    name: str
    exists: bool  # X is on the broker
    matches: bool  # ... and already as the file wants it
    hold_exists: bool
    hold_bound: bool  # the holding queue still has bindings (route-back not finished)


def stage(seen: Seen) -> tuple[Step, ...]:
    """The steps left to run, in order; empty when there is nothing to do."""
    if not seen.hold_exists:
        if not seen.exists or seen.matches:
            return ()
        return STEPS
    if seen.exists and not seen.matches:
        return STEPS[1:]  # route-to-hold again (idempotent), drain, ...
    if not seen.exists:
        return STEPS[4:]
    if seen.hold_bound:
        return STEPS[5:]
    return STEPS[6:]


@dataclass(frozen=True)
class Migration:
    queue: Queue  # the file's definition
    differences: tuple[str, ...]  # what the broker has, against the file ("" when resuming)
    messages: int  # in X and its holding queue, from the (lagging) statistics
    steps: tuple[Step, ...]
    bindings: tuple[Binding, ...]  # the file's bindings to X

    @property
    def name(self) -> str:
        return self.queue.name


def plan_migrations(
    changes: Sequence[Change], live: LiveState, bindings: Iterable[Binding]
) -> list[Migration]:
    """Every queue that needs a migration, or has one under way, in the plan's order."""
    wanted = list(bindings)
    out = []
    for change in changes:
        if change.object != "queue" or not isinstance(change.item, Queue):
            continue
        queue = change.item
        current = live.queues.get(queue.name)
        hold = live.queues.get(hold_queue(queue.name))
        differences = () if current is None else tuple(queue_differences(current, queue))
        seen = Seen(
            name=queue.name,
            exists=current is not None,
            matches=current is not None and not differences,
            hold_exists=hold is not None,
            hold_bound=any(b.destination == hold_queue(queue.name) for b in live.bindings),
        )
        steps = stage(seen)
        if not steps:
            continue
        messages = (current.messages if current else 0) + (hold.messages if hold else 0)
        # Bindings from exchanges the broker lacks yet are ``apply``'s to make, afterwards.
        own = tuple(
            b for b in wanted
            if b.destination == queue.name
            and (b.source in live.exchanges or b.source.startswith("amq."))
        )
        out.append(Migration(queue, differences, messages, steps, own))
    return out


def new_quorum_queues(migrations: Sequence[Migration], live: LiveState) -> int:
    """How many more quorum queues the broker holds once ``migrations`` are done: each queue
    redeclared as quorum that is not a quorum queue on the broker now (holding queues are
    classic). RabbitMQ 3.x reserves open files for each (diff.capacity_problem)."""
    return sum(
        1
        for m in migrations
        if "redeclare" in m.steps
        and m.queue.queue_type == "quorum"
        and getattr(live.queues.get(m.name), "type", None) != "quorum"
    )


# Steps that fill a tier's holding queue, run before its main queue is rebuilt.
EARLY: tuple[Step, ...] = ("hold", "route-to-hold", "drain")


def schedule(migrations: Sequence[Migration]) -> list[tuple[Migration, tuple[Step, ...]]]:
    """The order to run the steps in: a main queue's tiers are emptied into their holding
    queues before the main queue is deleted, and refilled after it is back.

    Held, a tier's message cannot expire, so none can be dead-lettered to the main queue in the
    instant it does not exist; and while it is rebuilt, retries routed to the tiers wait in the
    holding queues. They wait longer than their delay, never less."""
    mains = {m.name for m in migrations if m.queue.role == "main"}
    order: list[tuple[Migration, tuple[Step, ...]]] = []
    later: dict[str, list[tuple[Migration, tuple[Step, ...]]]] = {}
    for migration in migrations:
        if migration.queue.role == "tier" and migration.queue.owner in mains:
            early = tuple(s for s in migration.steps if s in EARLY)
            rest = tuple(s for s in migration.steps if s not in EARLY)
            if early:
                order.append((migration, early))
            if rest:
                later.setdefault(migration.queue.owner, []).append((migration, rest))
    for migration in migrations:
        if migration.queue.role == "tier" and migration.queue.owner in mains:
            continue
        order.append((migration, migration.steps))
        order += later.pop(migration.name, [])
    return order


# Policy keys that would make the holding queue drop or expire what it holds.
HOLD_HAZARDS = ("max-length", "max-length-bytes", "message-ttl", "expires")


def hold_hazards(migrations: Sequence[Migration], policies: Iterable[LivePolicy]) -> list[str]:
    """Policies that would apply to a holding queue and drop, expire or delete what it holds;
    one line each. ``migrate`` refuses to start while there is one."""
    lines = []
    for migration in migrations:
        if "hold" not in migration.steps:
            continue  # the holding queue exists already and keeps what it has
        hold = hold_queue(migration.name)
        for policy in policies:
            keys = sorted(set(policy.definition) & set(HOLD_HAZARDS))
            if not keys or policy.apply_to not in ("queues", "all", "classic_queues"):
                continue
            try:
                matches = re.search(policy.pattern, hold) is not None
            except re.error:
                matches = True  # cannot tell: better to ask than to lose messages
            if matches:
                kind = "operator policy" if policy.operator else "policy"
                lines.append(
                    f"{kind} {policy.name} ({', '.join(keys)}) would apply to the holding queue "
                    f"{hold} and could drop messages while they wait there; narrow its "
                    "pattern first"
                )
    return lines


_WHAT: dict[Step, str] = {
    "hold": "declare {hold} (classic, no TTL, no limit) to hold the messages meanwhile",
    "route-to-hold": "bind {hold} like {name}, then unbind {name}: new messages wait in {hold}",
    "drain": "move the messages of {name} into {hold}, each confirmed before it is acked",
    "release": "close the connections consuming {name}; delete {name} once it is empty",
    "redeclare": "declare {name} as the file says ({summary})",
    "route-back": "bind {name}, then unbind {hold}: new messages go to {name} again",
    "refill": "move the messages of {hold} into {name}, each confirmed; delete {hold}",
}


def describe(migration: Migration) -> list[str]:
    """What ``migrate`` will do to one queue and its messages, one line per step."""
    name, queue = migration.name, migration.queue
    summary = ", ".join(
        f"{k}: {v}" for k, v in sorted(queue.arguments.items()) if k != "x-queue-type"
    )
    summary = queue.queue_type + (f"; {summary}" if summary else "")
    head = f"queue {name}: " + (
        "; ".join(migration.differences)
        if migration.differences
        else "a migration was interrupted; resuming"
    )
    head += f" ({plural(migration.messages, 'message')}, all kept)"
    lines = [head]
    for step in migration.steps:
        lines.append(
            f"  {step:<13} " + _WHAT[step].format(name=name, hold=hold_queue(name), summary=summary)
        )
    return lines


# --- renames: ``renamed_from`` ---------------------------------------------------------------


@dataclass(frozen=True)
class Rename:
    """A queue the file renamed (``renamed_from: old`` on ``new``) whose objects are still on
    the broker: ``migrate`` unbinds ``old`` from every exchange, moves the messages of its
    tiers and of ``old`` (and of its holding queue, if a migration of it was interrupted) into
    ``new`` and those of its parking queue into ``new``'s, then deletes them, its exchanges and
    its policy."""

    old: str
    new: str
    detail: str
    moves: tuple[tuple[str, str], ...]  # (live queue of old, queue of the file), in order
    exchanges: tuple[str, ...]  # old's retry and lanes exchanges, deleted last
    policy: str | None  # old's ``rabbit-retry:`` policy


def plan_renames(changes: Sequence[Change], live: LiveState) -> list[Rename]:
    """The renames ``changes`` (``diff``) hold, with what to move where; pure. Tiers first
    (a retrying message goes back early, to the new queue, rather than through the old one),
    then the parking queue, then the holding queue and the old queue, which is deleted last of
    its queues: its tiers expire into it (through the default exchange, which nothing can
    redirect), and while it exists its objects are still found as its own. Its own dead
    letters, which go to its first tier or parking queue, are routed first to where those are
    moved (``migrate._redirect_dead_letters``)."""
    out = []
    for change in changes:
        if change.kind != "migrate" or change.renamed_to is None:
            continue
        old, new = change.name.split(" -> ")[0], change.renamed_to
        found = group_queues(old, live)
        moves = [(q.name, new) for q, role in found if role == "tier"]
        for source, target in ((naming.parking_queue(old), naming.parking_queue(new)),
                               (naming.migrating_queue(old), new), (old, new)):
            if source in live.queues:
                moves.append((source, target))
        exchanges = tuple(n for n in (naming.lanes_exchange(old), naming.retry_exchange(old))
                          if n in live.exchanges)
        policy = next((p.name for p in live.policies
                       if not p.operator and p.name == naming.policy_name(old)), None)
        out.append(Rename(old, new, change.detail, tuple(moves), exchanges, policy))
    return out


def describe_rename(rename: Rename) -> list[str]:
    """What ``migrate`` will do for one rename, one line per step."""
    lines = [f"queue {rename.old} -> {rename.new}: renamed in the file; {rename.detail}",
             f"  unbind        unbind {rename.old} from every exchange: no new copies arrive",
             f"  reroute       {naming.retry_exchange(rename.old)} to where each of its "
             f"queues is moved: what {rename.old} dead-letters meanwhile never reaches a "
             "deleted queue"]
    for source, target in rename.moves:
        lines.append(f"  move          the messages of {source} into {target}, each confirmed "
                     f"before it is acked; delete {source}")
    for name in rename.exchanges:
        lines.append(f"  delete        exchange {name}")
    if rename.policy:
        lines.append(f"  delete        policy {rename.policy}")
    return lines


# --- recognising copies -------------------------------------------------------------------------

Identity = tuple[str, str]


def identity(message_id: str | None, body: bytes) -> Identity | None:
    """What makes two deliveries the same message: its id and its body. A message without an
    id cannot be told from another one like it, so it is never dropped as a copy."""
    if not message_id:
        return None
    return message_id, hashlib.sha256(body).hexdigest()


class Copies:
    """The messages already in a destination, as a multiset: each one met again in the source
    is a copy, and is dropped once per time it is held."""

    def __init__(self, held: Iterable[Identity | None] = ()) -> None:
        self._held: Counter[Identity] = Counter(i for i in held if i is not None)
        self._left = sum(self._held.values())

    def __len__(self) -> int:
        return self._left

    def take(self, key: Identity | None) -> bool:
        """True (and forget one of them) when ``key`` is already held at the destination."""
        if key is None or self._held[key] <= 0:
            return False
        self._held[key] -= 1
        self._left -= 1
        return True


def moved_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headers of a moved copy: the original's, without the broker's delivery counts."""
    return {k: v for k, v in (headers or {}).items() if k not in ANNOTATIONS}


def is_marker(headers: Mapping[str, Any] | None) -> bool:
    value = (headers or {}).get(MARKER_HEADER)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value == MARKER_VALUE
