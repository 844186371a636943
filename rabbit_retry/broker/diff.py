"""Plan vs live broker -> the list of changes ``apply`` would make; pure.

Like Terraform's plan, but it never proposes to destroy data to converge: a live exchange that
differs from the file is a ``conflict`` for a human to resolve; a live queue that differs is a
``migrate``, which ``apply`` refuses and ``rabbit-retry migrate`` carries out, moving every
message (broker/migrate_plan.py); and the only deletions it ever
proposes are retry tiers that left the file (``prune``), and the objects of a queue that left
the file (orphans: ``Change.orphan``), which ``apply`` deletes only with ``--prune`` and only
while empty (orphans only when ``--target`` names their queue: ``apply_work``). Main queues,
parking queues and anything the file does not derive are never touched otherwise.

``diff(plan, live, targets=...)`` compares only the part of the file those queues need
(``select``): a conflict elsewhere does not concern it. Orphans are always found against the
whole file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from rabbit_retry.broker.inspect import (
    LiveExchange,
    LivePolicy,
    LiveQueue,
    LiveState,
    NodeCapacity,
)
from rabbit_retry.broker.replicas import GROUP_SIZE, Replication, replicas_note
from rabbit_retry.text import numbered, plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.compile import RING_IN_LANE_ORDER
from rabbit_retry.topology.durations import label, parse_duration
from rabbit_retry.topology.plan import Binding, Exchange, Plan, Policy, Queue, Role

# ``grow``: a live quorum queue with fewer replicas than the file asks for; apply cannot add
# them (broker/replicas.py), the detail says what can. ``migrate``: a queue the broker cannot
# change in place, rebuilt by ``rabbit-retry migrate`` with its messages.
ChangeKind = Literal[
    "create", "unchanged", "update", "conflict", "migrate", "unbind", "prune", "keep", "grow"
]
ObjectKind = Literal["exchange", "queue", "binding", "policy"]
KINDS: tuple[ChangeKind, ...] = (
    "create", "unchanged", "update", "conflict", "migrate", "unbind", "prune", "keep", "grow"
)

# The queue type lives in LiveQueue.type: a classic queue declared without the argument is
# still classic, so the argument itself is never compared.
_TYPE_ARGUMENT = "x-queue-type"


@dataclass(frozen=True)
class Change:
    kind: ChangeKind
    object: ObjectKind
    name: str
    detail: str = ""
    item: Exchange | Queue | Binding | Policy | None = None
    # A ``migrate`` of a parking queue that differs only in its type (a classic one the file
    # now wants quorum): apply leaves it for ``migrate`` and goes on (``deferred``).
    type_only: bool = False
    # An object of a queue the file no longer declares (its ``item.owner``/``item.queue``).
    orphan: bool = False
    # The ``migrate`` of a queue the file renamed (``renamed_from``): the file's new name.
    renamed_to: str | None = None
    # The ``migrate`` of an ordered queue that gets more lanes: (lanes now, lanes in the file).
    lanes: tuple[int, int] | None = None

    @property
    def owner(self) -> str | None:
        """The main queue of the file (or, for an orphan, of the live broker) it belongs to."""
        if self.renamed_to is not None:
            return self.renamed_to
        item = self.item
        if isinstance(item, Queue | Exchange):
            return item.owner
        if isinstance(item, Policy):
            return item.queue
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "object": self.object, "name": self.name,
                               "orphan": self.orphan, "owner": self.owner}
        if self.renamed_to is not None:
            out["renamed_to"] = self.renamed_to
        if self.lanes is not None:
            out["lanes"] = {"broker": self.lanes[0], "file": self.lanes[1]}
        if isinstance(self.item, Binding):
            out |= {
                "source": self.item.source,
                "destination": self.item.destination,
                "routing_key": self.item.routing_key,
                "arguments": dict(self.item.arguments),
            }
        if isinstance(self.item, Policy):
            out |= {
                "pattern": self.item.pattern,
                "definition": dict(self.item.definition),
                "priority": self.item.priority,
            }
        out["detail"] = self.detail
        return out


def binding_name(binding: Binding) -> str:
    """How a binding is named to users: ``source -> destination [routing key]``."""
    text = f"{binding.source} -> {binding.destination} [{binding.routing_key}]"
    if binding.arguments:
        text += " " + json.dumps(dict(binding.arguments), sort_keys=True, default=str)
    return text


def show(value: Any) -> str:
    """A value as the user wrote it in YAML (true, 5000, orders.retry, "")."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value, default=str)


def _same(a: Any, b: Any) -> bool:
    # Python calls True == 1; the broker does not, so compare booleans by type as well.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _argument_differences(
    live: Mapping[str, Any], file: Mapping[str, Any], ignore: frozenset[str] = frozenset()
) -> list[str]:
    out = []
    for key in sorted(set(live) | set(file)):
        if key == _TYPE_ARGUMENT or key in ignore:
            continue
        if key not in live:
            out.append(f"{key}: live absent, file {show(file[key])}")
        elif key not in file:
            out.append(f"{key}: live {show(live[key])}, file absent")
        elif not _same(live[key], file[key]):
            out.append(f"{key}: live {show(live[key])}, file {show(file[key])}")
    return out


def _field(name: str, live: Any, file: Any) -> list[str]:
    return [] if _same(live, file) else [f"{name}: live {show(live)}, file {show(file)}"]


def _both_quorum(live: LiveQueue, queue: Queue) -> bool:
    return live.type == "quorum" and queue.queue_type == "quorum"


def queue_differences(live: LiveQueue, queue: Queue) -> list[str]:
    # A quorum queue's replicas are not a conflict: see replication_of.
    ignore = frozenset({GROUP_SIZE}) if _both_quorum(live, queue) else frozenset()
    return [
        *_field("type", live.type, queue.queue_type),
        *_field("durable", live.durable, queue.durable),
        *_field("auto_delete", live.auto_delete, False),
        *_argument_differences(live.arguments, queue.arguments, ignore),
    ]


def replication_of(live: LiveQueue, queue: Queue, nodes: tuple[str, ...]) -> Replication:
    """The replicas of a live quorum queue against those ``queue`` asks for."""
    asked = queue.arguments.get(GROUP_SIZE)
    return Replication(
        queue=live.name,
        leader=live.leader,
        members=live.members,
        online=live.online,
        asked=asked if isinstance(asked, int) and not isinstance(asked, bool) else None,
        nodes=nodes,
    )


def _replicas_change(live: LiveQueue, queue: Queue, state: LiveState) -> Change | None:
    """A quorum queue's change when only its replicas (argument or members) differ from the
    file (anything else differing makes it a migration)."""
    if not _both_quorum(live, queue):
        return None
    replication = replication_of(live, queue, state.nodes)
    note = replicas_note(
        queue.name, state.vhost, replication.asked, live.arguments.get(GROUP_SIZE), replication
    )
    if note is None:
        return None
    short, text = note
    return Change("grow" if short else "unchanged", "queue", queue.name, text, queue)


def exchange_differences(live: LiveExchange, exchange: Exchange) -> list[str]:
    return [
        *_field("type", live.type, exchange.type),
        *_field("durable", live.durable, exchange.durable),
        *_field("auto_delete", live.auto_delete, exchange.auto_delete),
        *_field("internal", live.internal, exchange.internal),
        *_argument_differences(live.arguments, exchange.arguments,
                               frozenset({RING_IN_LANE_ORDER[0]})),
    ]


def _queue_summary(queue: Queue) -> str:
    parts = [queue.queue_type, queue.role]
    if queue.delay_ms is not None:
        parts.append(f"ttl {label(queue.delay_ms)}")
    return ", ".join(parts)


def _compare(
    object_kind: ObjectKind,
    name: str,
    item: Exchange | Queue,
    differences: list[str] | None,
    created: str,
) -> Change:
    if differences is None:
        return Change("create", object_kind, name, created, item)
    if differences:
        return Change("conflict", object_kind, name, "; ".join(differences), item)
    return Change("unchanged", object_kind, name, "", item)


def _queue_change(queue: Queue, live: LiveState) -> Change:
    live_queue = live.queues.get(queue.name)
    held = live.queues.get(naming.migrating_queue(queue.name))
    differences = None if live_queue is None else queue_differences(live_queue, queue)
    if live_queue is not None and differences == [] and held is None:
        # Only its replicas differ (or nothing): the broker adds members live, or leaves them.
        replicas = _replicas_change(live_queue, queue, live)
        if replicas is not None:
            return replicas
    if differences and queue.role in ("lane", "held") and held is None:
        # Moved through a holding queue, a lane would leave the lanes exchange's ring for a
        # while and come back in another place: keys would run in another lane than their
        # earlier messages, and a held queue's entries would wait apart from their lane.
        return Change("conflict", "queue", queue.name, (
            f"{'; '.join(differences)}; an ordered queue's lanes cannot be rebuilt in place "
            "without breaking its keys' order: declare a new ordered queue and move the "
            "publishers to it"), queue)
    if differences or held is not None:
        # The broker cannot change a queue's type or arguments in place: ``migrate`` builds
        # it again beside a holding queue and moves every message.
        messages = (live_queue.messages if live_queue else 0) + (held.messages if held else 0)
        what = "; ".join(differences or ["a migration is under way"])
        detail = f"{what}; migrate keeps its {plural(messages, 'message')}"
        type_only = live_queue is not None and held is None and (
            _untyped(live_queue.arguments) == _untyped(queue.arguments))
        return Change("migrate", "queue", queue.name, detail, queue, type_only=type_only)
    return _compare("queue", queue.name, queue, differences, _queue_summary(queue))


# What a parking queue's type brings with it (compile.py): the rest must match for a change of
# type alone.
_TYPE_BOUND = frozenset({"x-queue-type", "x-delivery-limit", "x-quorum-initial-group-size"})


def _untyped(arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in arguments.items() if k not in _TYPE_BOUND}


def _looks_like_tier(live: LiveQueue, owner: str) -> bool:
    # Only a queue this tool made is ever proposed for deletion: its name and its wiring
    # (TTL, dead-lettering straight back to its main queue) must both say it is a tier.
    args = live.arguments
    return (
        naming.tier_label_of(live.name, owner) is not None
        and "x-message-ttl" in args
        and args.get("x-dead-letter-exchange") == ""
        and args.get("x-dead-letter-routing-key") == owner
    )


def _obsolete(plan: Plan, live: LiveState) -> Iterable[Change]:
    planned = {q.name for q in plan.queues} | {e.name for e in plan.exchanges}
    for main in plan.main_queues:
        for name in sorted(live.queues):
            queue = live.queues[name]
            if name in planned or not _looks_like_tier(queue, main.name):
                continue
            tier_label = naming.tier_label_of(name, main.name)
            assert tier_label is not None
            item = Queue(
                name=name,
                role="tier",
                owner=main.name,
                arguments=dict(queue.arguments),
                durable=queue.durable,
                delay_ms=parse_duration(tier_label),
            )
            if queue.messages:
                detail = f"obsolete, {plural(queue.messages, 'message')} still in it"
                yield Change("keep", "queue", name, detail, item)
            else:
                yield Change("prune", "queue", name, "obsolete, empty", item)


def _misrouting(plan: Plan, live: LiveState) -> Iterable[Change]:
    """Live ``Q`` keys on ``Q.retry`` to tiers that are no longer first, or to ``Q.parking``
    where the file no longer parks ``Q``'s dead letters, or to a tier where it now does.

    Dead letters from ``Q`` are routed with key ``Q``; left bound, an old first tier would get a
    copy of every one of them and each message would come back twice (an overflowed or expired
    one, never: the broker drops it on its way back, topology/limits.py).
    """
    wanted = {b.key for b in plan.bindings}
    mains = {q.name for q in plan.main_queues}
    for binding in live.bindings:
        owner = binding.routing_key
        if (
            owner in mains
            and binding.source == naming.retry_exchange(owner)
            and binding.key not in wanted
        ):
            keyed = [b.destination for b in plan.bindings
                     if b.source == binding.source and b.routing_key == owner]
            if naming.tier_label_of(binding.destination, owner) is not None:
                why = (f"{binding.destination} is no longer the first tier of {owner}"
                       if any(naming.tier_label_of(d, owner) for d in keyed) else
                       f"what {owner} dead-letters (overflowed, expired) no longer goes to a "
                       "tier, from which the broker would drop it")
            elif binding.destination == naming.parking_queue(owner):
                why = f"the file no longer parks what {owner} dead-letters"
            elif binding.destination == naming.rescue_queue(owner):
                why = (f"a `rabbit-retry rescue` of {owner} that runs or did not finish: it gets "
                       f"a copy of every message {owner} dead-letters; run rescue again")
            else:
                continue
            yield Change("unbind", "binding", binding_name(binding), why, binding)


def diff(
    whole: Plan, live: LiveState, *, targets: Collection[str] | None = None
) -> list[Change]:
    """Every planned object as create / unchanged / conflict, then unbinds, then prune / keep,
    then the orphans.

    Obsolete tiers and orphans are always reported (``prune`` if the statistics say empty,
    ``keep`` with the message count if not); ``apply`` deletes them only when asked to, and only
    if the broker finds them empty at that moment. With ``targets`` (main queues of the file,
    or orphans), only what they need (``select``) and their own orphans.
    """
    plan = whole if targets is None else select(whole, targets)
    changes: list[Change] = []
    for exchange in plan.exchanges:
        live_exchange = live.exchanges.get(exchange.name)
        differences = None if live_exchange is None else exchange_differences(
            live_exchange, exchange
        )
        if live_exchange is None and exchange.role == "lanes-exchange" and _ring_kept(
                live.version):
            exchange = replace(exchange, arguments={
                **exchange.arguments, RING_IN_LANE_ORDER[0]: RING_IN_LANE_ORDER[1]})
        changes.append(_compare("exchange", exchange.name, exchange, differences, exchange.type))
    for queue in plan.queues:
        changes.append(_queue_change(queue, live))
    live_bindings = {b.key for b in live.bindings}
    for binding in plan.bindings:
        kind: ChangeKind = "unchanged" if binding.key in live_bindings else "create"
        changes.append(Change(kind, "binding", binding_name(binding), "", binding))
    changes += _policy_changes(plan, live)
    changes += _misrouting(plan, live)
    changes += _obsolete(plan, live)
    changes += _lane_changes(plan, live)
    changes += [c for c in orphans(whole, live) if targets is None or c.owner in targets]
    return changes


def select(plan: Plan, targets: Collection[str]) -> Plan:
    """The part of ``plan`` the main queues ``targets`` need: the objects they compile to, the
    bindings that feed them and the exchanges of those bindings; pure, in ``plan``'s order."""
    queues = tuple(q for q in plan.queues if q.owner in targets)
    derived = {e.name for e in plan.exchanges if e.owner in targets}
    reached = {q.name for q in queues} | derived
    bindings = tuple(b for b in plan.bindings if b.destination in reached)
    sources = {b.source for b in bindings}
    return Plan(
        exchanges=tuple(e for e in plan.exchanges if e.name in derived or e.name in sources),
        queues=queues,
        bindings=bindings,
        policies=tuple(p for p in plan.policies if p.queue in targets),
    )


def unknown_targets(plan: Plan, live: LiveState, targets: Iterable[str]) -> list[str]:
    """The ``targets`` that name neither a queue of the file nor an orphan of ``live``."""
    known = {q.name for q in plan.main_queues} | {c.owner for c in orphans(plan, live)}
    return [t for t in targets if t not in known]


# --- orphans: objects of ours for a queue the file no longer declares -------------------------


def _main_signature(queue: LiveQueue) -> bool:
    # Dead-lettering into its own retry exchange with its own name: only a main queue of ours.
    args = queue.arguments
    return (args.get("x-dead-letter-exchange") == naming.retry_exchange(queue.name)
            and args.get("x-dead-letter-routing-key") == queue.name)


def _tier_owner(queue: LiveQueue) -> str | None:
    owner = queue.arguments.get("x-dead-letter-routing-key")
    if isinstance(owner, str) and owner and _looks_like_tier(queue, owner):
        return owner
    return None


def _orphan_owners(plan: Plan, live: LiveState) -> list[str]:
    planned = {q.name for q in plan.queues}
    owners = set()
    for queue in live.queues.values():
        if queue.name in planned:
            continue
        if _main_signature(queue):
            owners.add(queue.name)
        owner = _tier_owner(queue)
        if owner is not None:
            owners.add(owner)
    for policy in live.policies:
        if not policy.operator and policy.name.startswith(naming.POLICY_PREFIX):
            owners.add(policy.name[len(naming.POLICY_PREFIX):])
    return sorted(owners - {q.name for q in plan.main_queues} - planned)


def _orphan_queues(owner: str, live: LiveState) -> list[tuple[LiveQueue, Role]]:
    """The live queues of ``owner`` with their roles, in the order they are deleted: those
    messages enter by first (main, lanes), then what they feed."""
    found: list[tuple[LiveQueue, Role]] = []
    main = live.queues.get(owner)
    if main is not None and _main_signature(main):
        found.append((main, "main"))
    lanes = sorted(_live_lanes(owner, live), key=lambda n: int(n.rsplit(".", 1)[1]))
    found += [(live.queues[n], "lane") for n in lanes]
    found += [(live.queues[h], "held") for h in (n + naming.HELD_SUFFIX for n in lanes)
              if h in live.queues]
    tiers = [n for n in live.queues if _tier_owner(live.queues[n]) == owner]
    found += [(live.queues[n], "tier")
              for n in sorted(tiers, key=lambda n: _delay(n, owner))]
    others: tuple[tuple[str, Role], ...] = (
        (naming.parking_queue(owner), "parking"), (naming.migrating_queue(owner), "main"))
    for name, role in others:
        if name in live.queues:
            found.append((live.queues[name], role))
    return found


def group_queues(owner: str, live: LiveState) -> list[tuple[LiveQueue, Role]]:
    """The live queues of ``owner`` (a queue the file no longer declares), with their roles."""
    return _orphan_queues(owner, live)


def _delay(tier: str, owner: str) -> int:
    tier_label = naming.tier_label_of(tier, owner)
    return parse_duration(tier_label) if tier_label else 0


def _fed_by(name: str, live: LiveState, derived: set[str]) -> list[Binding]:
    return [b for b in live.bindings if b.destination == name and b.source not in derived]


def _renamed_to(owner: str, fed: list[Binding], plan: Plan) -> str | None:
    """A queue of the file bound exactly as ``owner`` is: likely its new name, if the file
    renamed it."""
    if not fed:
        return None
    wanted = {(b.source, b.routing_key, _args(b)) for b in fed}
    for queue in plan.main_queues:
        mine = {(b.source, b.routing_key, _args(b)) for b in plan.bindings
                if b.destination in (queue.name, naming.lanes_exchange(queue.name))}
        if mine == wanted:
            return queue.name
    return None


def _args(binding: Binding) -> str:
    return json.dumps(dict(binding.arguments), sort_keys=True, default=str)


def orphans(plan: Plan, live: LiveState) -> list[Change]:
    """The live queues, exchanges and ``rabbit-retry:`` policy of every queue of ours that
    ``plan`` no longer declares (removed or renamed in the file): ``prune`` while every queue
    of that queue's group is empty and unused, ``keep`` (with the count) otherwise. A main
    queue still bound from an exchange is said so: it gets a copy of every message routed
    there."""
    out: list[Change] = []
    renames = dict(plan.renames)
    for owner in _orphan_owners(plan, live):
        queues = _orphan_queues(owner, live)
        if owner in renames:
            out.append(rename_change(owner, renames[owner], queues))
        busy = any(q.messages or q.consumers for q, _ in queues)
        out += [_orphan_queue(plan, live, owner, queue, role, busy, owner in renames)
                for queue, role in queues]
        out += _orphan_rest(live, owner, busy)
    return out


def _orphan_queue(plan: Plan, live: LiveState, owner: str, queue: LiveQueue, role: Role,
                  busy: bool, renamed_in_file: bool) -> Change:
    """One queue of an orphaned group, and why it is pruned or kept."""
    parts = [f"not in the file (queue {owner})"]
    if queue.messages:
        parts.append(f"{plural(queue.messages, 'message')} in it")
    if queue.consumers:
        parts.append(f"{plural(queue.consumers, 'consumer')}")
    derived = {naming.retry_exchange(owner), naming.lanes_exchange(owner)}
    fed = _fed_by(queue.name, live, derived) if role in ("main", "lane") else []
    if fed:
        sources = ", ".join(sorted({f"{b.source} [{b.routing_key}]" for b in fed}))
        parts.append(f"still bound from {sources}: it gets a copy of every message "
                     "routed there")
        renamed = _renamed_to(owner, fed, plan)
        if renamed and not renamed_in_file:
            parts.append(f"renamed to {renamed}? its messages stay here")
    if not queue.messages and not queue.consumers and busy:
        parts.append("kept while its group holds messages")
    item = Queue(queue.name, role, owner, dict(queue.arguments), queue.durable)
    kind: ChangeKind = "keep" if busy else "prune"
    return Change(kind, "queue", queue.name, "; ".join(parts), item, orphan=True)


def _orphan_rest(live: LiveState, owner: str, busy: bool) -> list[Change]:
    """An orphaned group's lanes and retry exchanges and its policy."""
    gone = f"not in the file (queue {owner})"
    kind: ChangeKind = "keep" if busy else "prune"
    out: list[Change] = []
    exchange_roles: tuple[tuple[str, Role], ...] = (
        (naming.lanes_exchange(owner), "lanes-exchange"),
        (naming.retry_exchange(owner), "retry-exchange"))
    for name, role in exchange_roles:
        exchange = live.exchanges.get(name)
        if exchange is None:
            continue
        item_x = Exchange(name, exchange.type, exchange.durable, exchange.auto_delete,
                          exchange.internal, dict(exchange.arguments), role, owner)
        out.append(Change(kind, "exchange", name, gone, item_x, orphan=True))
    policy = next((p for p in live.policies if not p.operator
                   and p.name == naming.policy_name(owner)), None)
    if policy is not None:
        item_p = Policy(policy.name, policy.pattern, {}, policy.priority, owner,
                        policy.apply_to)
        out.append(Change(kind, "policy", policy.name, gone, item_p, orphan=True))
    return out


def rename_change(old: str, new: str, queues: Iterable[tuple[LiveQueue, Role]]) -> Change:
    """The rename the file declares (``renamed_from: old`` on ``new``) while objects of
    ``old`` are still on the broker: ``migrate`` moves their messages and deletes them;
    ``apply`` goes on without it (``deferred``)."""
    held = {"main": 0, "parking": 0, "tier": 0}
    for queue, role in queues:
        if role in held:
            held[role] += queue.messages
    detail = f"migrate moves its {plural(held['main'], 'message')}"
    extra = []
    if held["parking"]:
        extra.append(f"{naming.parking_queue(old)}: {held['parking']} parked")
    if held["tier"]:
        extra.append(f"tiers: {held['tier']} retrying")
    if extra:
        detail += f" ({', '.join(extra)})"
    detail += f" into {new} and deletes the objects of {old}"
    return Change("migrate", "queue", f"{old} -> {new}", detail, None, renamed_to=new)


def _live_lanes(main: str, live: LiveState) -> set[str]:
    prefix = naming.lane_queue(main, 0)[:-1]
    return {name for name in live.queues
            if name.startswith(prefix) and name[len(prefix):].isdigit()}


def _lanes_under_way(main: str, live: LiveState, lanes: int) -> tuple[int, int] | None:
    """A change of ``main``'s lanes that ``migrate`` began and has not made whole (its marker
    queue is still there): (lanes before, lanes after). Of two (a run taking lanes away stopped
    between declaring the next step's marker and deleting its own), the one that starts from
    the ``lanes`` on the broker."""
    prefix = naming.lanes_exchange(main) + "."
    found = []
    for name in live.queues:
        before, sep, after = name.removeprefix(prefix).partition("-to-")
        if name.startswith(prefix) and sep and before.isdigit() and after.isdigit():
            found.append((int(before), int(after)))
    return min(found, key=lambda f: f[0] != lanes, default=None)


def _lane_changes(plan: Plan, live: LiveState) -> Iterable[Change]:
    """A live queue whose ordering the file changes. More lanes is a ``migrate`` (it adds them
    so that a key that moves to a new lane runs there only after its earlier messages in the
    old one); so is fewer on RabbitMQ 4.3 and later for a lanes exchange ``apply`` marked as
    bound in lane order (the last lanes are taken away, and their keys wait in the remaining
    ones until the removed ones are done with them). Fewer lanes elsewhere, or ordered keys
    turned on or off, would send some keys' messages down another path while earlier ones wait
    on the old one: refused. So is either change while a lane is not bound exactly once."""
    for main in plan.main_queues:
        if main.name not in live.queues:
            continue
        wanted = {q.name for q in plan.queues_of(main.name) if q.role == "lane"}
        there = _live_lanes(main.name, live)
        under_way = _lanes_under_way(main.name, live, len(there))
        if under_way is not None and under_way[1] == len(wanted):
            yield Change("migrate", "queue", main.name, _lanes_text(*under_way, resumed=True),
                         main, lanes=under_way)
            continue
        if under_way is not None and len(wanted) < under_way[1] < under_way[0] == len(there):
            # taking lanes away one at a time: a step under way, more to go
            lanes = (len(there), len(wanted))
            yield Change("migrate", "queue", main.name, _lanes_text(*lanes, resumed=True),
                         main, lanes=lanes)
            continue
        if under_way is not None:
            detail = (f"migrate began taking it from {under_way[0]} to {under_way[1]} lanes; the "
                      f"file says {len(wanted)}: run migrate with a file of {under_way[1]} lanes "
                      "to finish that first")
            yield Change("conflict", "queue", main.name, detail, main)
            continue
        if wanted != there and (change := _lane_change(main, wanted, there, live)) is not None:
            yield change


def _lane_change(main: Queue, wanted: set[str], there: set[str], live: LiveState
                 ) -> Change | None:
    """A live queue's lanes ``there``, the file's ``wanted`` (they differ), no change under
    way: the ``migrate`` that makes them match, the ``conflict`` that refuses it, or None (a
    plain queue nothing reaches yet)."""
    if not there:
        fed = [b for b in live.bindings if b.destination == main.name
               and b.destination_type == "queue"
               and b.source != naming.retry_exchange(main.name)]
        if not fed:
            return None  # nothing reaches it yet: ordering it changes no path
        detail = (f"the file orders it with {len(wanted)} lanes, but it is a plain queue "
                  "on the broker that messages reach directly; making a live queue ordered "
                  "is not supported yet: declare a new ordered queue and move publishers")
    elif not wanted:
        detail = (f"ordered with {len(there)} lanes on the broker, plain in the file; a "
                  "live ordered queue cannot be made plain yet")
    elif (unbound := _not_bound_once(main.name, there, live)):
        detail = (f"ordered with {len(there)} lanes on the broker, {len(wanted)} in the "
                  f"file, but {', '.join(unbound)} {'is' if len(unbound) == 1 else 'are'} "
                  f"not bound to {naming.lanes_exchange(main.name)} once, as apply binds "
                  f"each lane (an apply that stopped midway?): run apply with a file of "
                  f"{len(there)} lanes first, then migrate")
    elif _movable(main.name, there, len(wanted), live):
        lanes = (len(there), len(wanted))
        return Change("migrate", "queue", main.name, _lanes_text(*lanes), main, lanes=lanes)
    else:
        detail = (f"ordered with {len(there)} lanes on the broker, {len(wanted)} in the "
                  f"file: the remaining lanes would take some keys while their earlier "
                  f"messages wait in the others; keep lanes: {len(there)} "
                  f"({_why_not_fewer(live)})")
    return Change("conflict", "queue", main.name, detail, main)


def _not_bound_once(main: str, there: set[str], live: LiveState) -> list[str]:
    """The live lanes of ``main`` not bound exactly once to its lanes exchange: a lane change
    counts on each lane's place in the ring, and a lane bound later than a lane change would
    take keys from the others without a gate."""
    exchange = naming.lanes_exchange(main)
    bound = [b.destination for b in live.bindings
             if b.source == exchange and b.destination_type == "queue"]
    return sorted((lane for lane in there if bound.count(lane) != 1),
                  key=lambda name: (len(name), name))


def _why_not_fewer(live: LiveState) -> str:
    if not _ring_kept(live.version):
        return (f"a live ordered queue can get fewer lanes on RabbitMQ 4.3 and later, not on "
                f"{live.version or 'this version'}: before 4.3 a node restart reorders the "
                "lanes exchange's ring")
    return ("its lanes exchange was declared before rabbit-retry bound lanes in order, or on "
            "RabbitMQ before 4.3, so which keys taking a lane away moves is unknown; declare a "
            "new ordered queue with fewer lanes and move the publishers to it")


def _movable(main: str, there: set[str], wanted: int, live: LiveState) -> bool:
    """Whether ``migrate`` can take the live lanes ``there`` (every one from 0 up) to
    ``wanted``: more on every version, fewer where the ring is known to be in lane order."""
    whole = there == {naming.lane_queue(main, n) for n in range(len(there))}
    return whole and (wanted > len(there) or _in_lane_order(main, live))


def _in_lane_order(main: str, live: LiveState) -> bool:
    """Whether the lanes exchange of ``main`` numbers its buckets in lane order: declared by
    an ``apply`` that binds lanes in order, on a version that keeps the ring through restarts
    (the argument says both), and on such a version still."""
    exchange = live.exchanges.get(naming.lanes_exchange(main))
    marked = exchange is not None and exchange.arguments.get(
        RING_IN_LANE_ORDER[0]) == RING_IN_LANE_ORDER[1]
    return marked and _ring_kept(live.version)


def _ring_kept(version: str) -> bool:
    """Whether the lanes exchange keeps its ring in lane order through a node restart (4.3 and
    later), so that taking the last lanes away moves only their keys."""
    parts = version.split(".")[:2]
    return all(p.isdigit() for p in parts) and len(parts) == 2 and (
        int(parts[0]), int(parts[1])) >= (4, 3)


def _lanes_text(before: int, after: int, *, resumed: bool = False) -> str:
    if after < before:
        gone = numbered("lane", after, before)
        said = ("migrate began taking away" if resumed else
                f"ordered with {before} lanes on the broker, {after} in the file: migrate takes "
                "away")
        return (f"{said} {gone}; their keys go to the remaining lanes and run there once their "
                "earlier messages in the removed lane are done, and a removed lane is deleted "
                "once it is")
    new = numbered("lane", before, after)
    said = ("migrate began adding" if resumed else
            f"ordered with {before} lanes on the broker, {after} in the file: migrate adds")
    return (f"{said} {new}; a key that moves to a new lane runs there once its earlier "
            "messages in the old lane are done")


def _policy_text(definition: Mapping[str, Any], priority: int) -> str:
    keys = ", ".join(f"{k}: {show(v)}" for k, v in sorted(definition.items()))
    return f"{{{keys}}} priority {priority}"


def _policy_changes(plan: Plan, live: LiveState) -> Iterable[Change]:
    """Each queue's tunables as one policy of its own, changed in place (no redeclare); one
    left by an earlier file for a queue of this file is deleted."""
    ours = {p.name: p for p in live.policies if not p.operator}
    planned = {p.name for p in plan.policies}
    for policy in plan.policies:
        current = ours.get(policy.name)
        wanted = _policy_text(policy.definition, policy.priority)
        if current is None:
            yield Change("create", "policy", policy.name, wanted, policy)
        elif (
            current.pattern != policy.pattern
            or current.apply_to != policy.apply_to
            or current.priority != policy.priority
            or not _same(dict(current.definition), dict(policy.definition))
        ):
            was = _policy_text(current.definition, current.priority)
            yield Change("update", "policy", policy.name, f"live {was}, file {wanted}", policy)
        else:
            yield Change("unchanged", "policy", policy.name, wanted, policy)
    for queue in plan.main_queues:
        name = naming.policy_name(queue.name)
        current = ours.get(name)
        if current is not None and name not in planned:
            gone = Policy(name, current.pattern, {}, current.priority, queue.name)
            yield Change("update", "policy", name, "no longer in the file: deleted", gone)


def _matches(policy: LivePolicy, queue: Queue) -> bool:
    if policy.apply_to not in ("queues", "all", f"{queue.queue_type}_queues"):
        return False
    try:
        return re.search(policy.pattern, queue.name) is not None
    except re.error:  # a pattern only Erlang's regex engine reads; say nothing rather than guess
        return False


def policy_notes(plan: Plan, live: LiveState) -> list[str]:
    """Every other policy and operator policy that also matches a queue whose tunables the file
    manages, and what it does to ours (RabbitMQ applies the one policy of highest priority, then
    merges the operator policy of highest priority in, the lower numeric limit winning)."""
    queues = {q.name: q for q in plan.queues}
    notes = []
    for ours in plan.policies:
        queue = queues[ours.queue]
        for other in sorted(live.policies, key=lambda p: (p.operator, -p.priority, p.name)):
            if other.name == ours.name or not _matches(other, queue):
                continue
            keys = ", ".join(sorted(other.definition)) or "no keys"
            if other.operator:
                notes.append(
                    f"operator policy {other.name} ({keys}) also applies to queue {queue.name}: "
                    f"where both set a limit, the lower one wins"
                )
            elif other.priority > ours.priority:
                notes.append(
                    f"policy {other.name} (priority {other.priority}, {keys}) wins over "
                    f"{ours.name} (priority {ours.priority}) on queue {queue.name}: the file's "
                    "tunables do not apply; raise policy.priority or change that policy"
                )
            elif other.priority == ours.priority:
                notes.append(
                    f"policy {other.name} has the same priority ({other.priority}) as "
                    f"{ours.name} on queue {queue.name}: which one applies is up to the broker; "
                    "give policy.priority another value"
                )
            else:
                notes.append(
                    f"policy {other.name} (priority {other.priority}, {keys}) loses to "
                    f"{ours.name} (priority {ours.priority}) on queue {queue.name}: its keys no "
                    "longer apply there"
                )
    return notes


@dataclass(frozen=True)
class AppliedPolicy:
    """The policies that apply to one queue of the file, as RabbitMQ picks them (and ``plan``
    reasons about them): among the live policies whose pattern and ``apply-to`` match the queue,
    the one of highest priority; several of that priority, the broker picks one. The operator
    policy of highest priority is merged in: where both set a limit, the lower one wins."""

    queue: str
    top: tuple[LivePolicy, ...]  # the matching policies of the highest priority
    operator: LivePolicy | None
    ours: str | None  # rabbit-retry:<queue>, when the file gives the queue a policy block
    ours_live: LivePolicy | None  # ... as the broker has it, when it has it

    @property
    def policy(self) -> LivePolicy | None:
        """The one policy that applies; None when none matches, or several tie."""
        return self.top[0] if len(self.top) == 1 else None

    @property
    def ours_applies(self) -> bool:
        return self.ours_live is not None and self.policy == self.ours_live

    @property
    def warning(self) -> str | None:
        """Why the file's tunables do not (or may not) apply to the queue; None when they do,
        or when the file has none for it. A policy of ours the broker lacks is drift, and is
        reported as such."""
        if self.ours_live is None or self.ours_applies:
            return None
        others = ", ".join(p.name for p in self.top if p.name != self.ours)
        priority = self.top[0].priority
        if self.ours_live in self.top:
            return (
                f"{self.queue}: policy {others} has the same priority ({priority}) as "
                f"{self.ours}: the broker applies one of them"
            )
        return (
            f"{self.queue}: policy {others} (priority {priority}) wins over {self.ours} "
            f"(priority {self.ours_live.priority}): the file's tunables do not apply"
        )

    def to_json(self) -> dict[str, Any]:
        policy, operator = self.policy, self.operator
        return {
            "name": policy.name if policy else None,
            "priority": policy.priority if policy else None,
            "definition": dict(policy.definition) if policy else {},
            "tied": [p.name for p in self.top] if len(self.top) > 1 else [],
            "operator_policy": operator.name if operator else None,
            "operator_definition": dict(operator.definition) if operator else {},
            "ours": self.ours,
            "ours_applies": self.ours_applies,
        }


def applied_policies(plan: Plan, live: LiveState) -> dict[str, AppliedPolicy]:
    """main queue of ``plan`` -> the policies that apply to it on ``live``; pure."""
    ours = {p.queue: p.name for p in plan.policies}
    out = {}
    for queue in plan.main_queues:
        matching = [p for p in live.policies if _matches(p, queue)]
        policies = sorted((p for p in matching if not p.operator),
                          key=lambda p: (-p.priority, p.name))
        operators = sorted((p for p in matching if p.operator),
                           key=lambda p: (-p.priority, p.name))
        top = tuple(p for p in policies if p.priority == policies[0].priority)
        mine = ours.get(queue.name)
        out[queue.name] = AppliedPolicy(
            queue=queue.name,
            top=top,
            operator=operators[0] if operators else None,
            ours=mine,
            ours_live=next((p for p in policies if p.name == mine), None),
        )
    return out


def count(changes: Iterable[Change]) -> dict[ChangeKind, int]:
    """How many changes of each kind, every kind present (zero when none)."""
    totals: dict[ChangeKind, int] = dict.fromkeys(KINDS, 0)
    for change in changes:
        totals[change.kind] += 1
    return totals


def deferred(change: Change) -> bool:
    """A parking queue that ``migrate`` must rebuild only for its type (a classic one the file
    now wants quorum, as it does by default for a quorum main queue): ``apply`` goes on without
    it. The live one keeps working as a parking queue meanwhile; only its replication differs
    from the file. A parking queue whose other arguments differ (a length limit, a TTL) blocks,
    as every other queue to rebuild does."""
    if change.kind == "migrate" and change.renamed_to is not None:
        return True  # a declared rename: apply makes the new queue, migrate moves the messages
    return change.kind == "migrate" and change.type_only and isinstance(change.item, Queue) and (
        change.item.role == "parking"
    )


def blocking(change: Change) -> bool:
    """A change ``apply`` refuses to go on with."""
    return change.kind == "conflict" or (change.kind == "migrate" and not deferred(change))


def deferred_notes(changes: Iterable[Change], file: str) -> list[str]:
    """What ``apply`` says of the parking queues it leaves for ``migrate``."""
    return [
        f"note: queue {c.name}: renamed in the file; `rabbit-retry migrate {file}` "
        f"{c.detail.removeprefix('migrate ')}"
        if c.renamed_to is not None else
        f"note: {c.name} is left as it is ({c.detail}); `rabbit-retry migrate {file}` "
        "rebuilds it"
        for c in changes
        if deferred(c)
    ]


def refusal(changes: Iterable[Change], vhost: str, file: str) -> list[str]:
    """Why ``apply`` will not go on, one line per object; empty when it can."""
    changes = [c for c in changes if blocking(c)]
    lines = [
        f"{c.object} {c.name} in vhost {vhost!r} differs from the file: {c.detail}"
        for c in changes
    ]
    if not lines:
        return []
    if any(c.kind == "conflict" for c in changes):
        lines.append(
            "nothing was changed; fix the file or the live exchange (an exchange must be "
            "deleted and redeclared by hand)"
        )
    if any(c.kind == "migrate" and not c.lanes for c in changes):
        lines.append(
            f"nothing was changed; `rabbit-retry migrate {file}` rebuilds these queues and "
            "keeps their messages"
        )
    elif any(c.kind == "migrate" for c in changes):
        fewer = {c.lanes[1] < c.lanes[0] for c in changes if c.kind == "migrate" and c.lanes}
        how = ("adds or takes away the lanes" if len(fewer) > 1 else
               "takes the lanes away" if True in fewer else "adds the lanes")
        lines.append(f"nothing was changed; `rabbit-retry migrate {file}` {how} and keeps each "
                     "key's order")
    return lines


def nothing_to_do(changes: Iterable[Change], *, prune: bool = False) -> bool:
    """True when ``apply`` (with ``--prune`` if ``prune``) would not touch the broker.

    With ``--prune`` a ``keep`` is work too: its count comes from statistics that lag, so the
    broker is asked again and decides.
    """
    idle: set[ChangeKind] = {"unchanged", "grow"}
    if not prune:
        idle |= {"keep", "prune"}
    return all(c.kind in idle or deferred(c) for c in changes)


# RabbitMQ 3.x reserves file handles for every quorum queue in its file handle cache, out of
# the node's open-file limit; once the cache is full, classic queue declarations and new vhosts
# wait forever for a handle, on every vhost of the node, until quorum queues are deleted.
# RabbitMQ 4.0 removed these reservations. Measured on 3.10: 3 per quorum queue.
QUORUM_FILE_HANDLES = 3


def new_quorum_queues(changes: Iterable[Change]) -> int:
    return sum(
        1
        for c in changes
        if c.kind == "create" and isinstance(c.item, Queue) and c.item.queue_type == "quorum"
    )


def capacity_problem(capacity: NodeCapacity, new_quorum: int) -> str | None:
    """Why declaring ``new_quorum`` more quorum queues could stall the whole broker, or None."""
    major = capacity.version.split(".", 1)[0]
    if new_quorum <= 0 or capacity.fd_total is None or not major.isdigit() or int(major) >= 4:
        return None
    # Keep a fifth of the handles, and some more, for connections and classic queues.
    allowed = max(0, (capacity.fd_total * 4 // 5 - 50) // QUORUM_FILE_HANDLES)
    total = capacity.quorum_queues + new_quorum
    if total <= allowed:
        return None
    return (
        f"refusing to declare {new_quorum} quorum queues: the broker would hold {total}, and "
        f"RabbitMQ {capacity.version} with an open-file limit of {capacity.fd_total} holds "
        f"about {allowed} before every queue declaration on the node stalls; raise the "
        "broker's open-file limit (ulimit -n, LimitNOFILE) or use classic queues for some; "
        "nothing was changed"
    )


def apply_work(changes: Iterable[Change], *, targeted: bool) -> list[Change]:
    """The changes ``apply`` acts on: orphans only when ``--target`` names their queue. A
    vhost may hold the queues of several files, each an orphan to the others: deleting one
    takes a request by name."""
    return [c for c in changes if targeted or not c.orphan]


def pending(changes: Iterable[Change], *, prune: bool = False) -> bool:
    """Whether ``apply`` (with ``--prune`` if ``prune``) has a change to make among
    ``changes`` (``apply_work``): what ``plan --detailed-exitcode`` exits 4 for. Obsolete
    objects still holding messages (``keep``) and missing replicas (``grow``) are not: apply
    cannot change them. A parking queue left for ``migrate`` (``deferred``) is pending too."""
    kinds: set[ChangeKind] = {"create", "update", "unbind"}
    if prune:
        kinds.add("prune")
    return any(c.kind in kinds or deferred(c) for c in changes)


def listed(change: Change) -> bool:
    """Whether the compact plan lists ``change``: every change, and an unchanged queue only
    with a note (its replicas)."""
    return change.kind != "unchanged" or (change.object == "queue" and bool(change.detail))
