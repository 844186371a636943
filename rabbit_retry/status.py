"""``rabbit-retry status``: where the messages of each queue in a topology are, and whether the
broker still has every object the file derives; ``status_view`` is how it reads on a terminal.

A missing tier, retry exchange or parking queue is the worst thing this can report: the broker
then drops messages silently (dead-lettering to nowhere), so drift is listed first and makes the
command exit 1 for monitoring to alert on. So does another policy that drops, expires or limits
the messages of any queue of the file (broker/hazards.py): a ``.*`` policy with a TTL empties
parking queues as surely as a missing tier.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Group, RenderableType
from rich.text import Text

from rabbit_retry.broker.counts import ready_and_consumers
from rabbit_retry.broker.diff import AppliedPolicy, Change, applied_policies, diff, replication_of
from rabbit_retry.broker.hazards import PolicyHazard, hazard_lines, policy_hazards
from rabbit_retry.broker.inspect import LiveState, read_live, with_exact_counts
from rabbit_retry.broker.management import Management
from rabbit_retry.broker.placement import single_node_notes
from rabbit_retry.broker.replicas import Replication
from rabbit_retry.settings import Settings
from rabbit_retry.tables import cell, new_table
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Exchange, Plan, Queue

SAMPLED_NOTE = (
    "ready, consumers, retrying and parked: exact, read now; unacked: the management API's"
    " sample, a few seconds old"
)
DriftKind = Literal["missing", "different", "misrouted"]
# The order drift is listed in: what loses messages first.
_KIND_ORDER: dict[DriftKind, int] = {"missing": 0, "different": 1, "misrouted": 2}
_RETRY_PATH = frozenset({"tier", "parking", "retry-exchange", "retry-binding"})
_ROLE_NAMES = {
    "tier": "retry tier",
    "parking": "parking queue",
    "retry-exchange": "retry exchange",
    "retry-binding": "retry route",
}


@dataclass(frozen=True)
class QueueStatus:
    """Message counts of one main queue; None where the queue does not exist."""

    queue: str
    ready: int | None
    unacked: int | None
    consumers: int | None
    retrying: int  # in every live Q.retry.* queue, old tiers still draining included
    parked: int | None
    tiers: tuple[tuple[str, int], ...]  # (tier queue, messages) for each live tier
    # (queue, messages) for Q and its tiers where a quorum queue holds messages it could not
    # dead-letter yet: a missing next queue, or a dead-letter cycle (docs/versions.md).
    held: tuple[tuple[str, int], ...] = ()
    # The queues of ``held`` whose next queue is there: the broker's cycle check holds them.
    stranded: tuple[str, ...] = ()
    # Each live quorum queue of Q (main, tiers, parking): its leader and replicas.
    replicas: tuple[Replication, ...] = ()
    # The policy (and operator policy) that applies to Q: the file's own, another that wins.
    policy: AppliedPolicy | None = None
    # An ordered queue's: keys held by a message waiting for a retry or parked (every retrying
    # message of an ordered queue holds its key; so does every parked one with on_park: hold,
    # and one on its way back through Q), and what waits in its lanes' held queues: the held
    # keys' later messages and each held key's hold record. None: not an ordered queue.
    held_keys: int | None = None
    held_messages: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "ready": self.ready,
            "unacked": self.unacked,
            "consumers": self.consumers,
            "retrying": self.retrying,
            "parked": self.parked,
            "tiers": dict(self.tiers),
            "held_for_dead_lettering": dict(self.held),
            "stranded_by_dead_letter_cycle": {q: n for q, n in self.held if q in self.stranded},
            "replicas": [r.to_json() for r in self.replicas],
            "policy": self.policy.to_json() if self.policy else None,
            **({} if self.held_keys is None else {"held_keys": self.held_keys,
                                                  "held_messages": self.held_messages}),
        }


@dataclass(frozen=True)
class Drift:
    kind: DriftKind
    object: str  # exchange | queue | binding
    name: str
    owner: str | None  # the main queue it belongs to, when it belongs to one
    role: str  # main | tier | parking | retry-exchange | user | retry-binding | binding
    detail: str

    @property
    def drops_messages(self) -> bool:
        """A missing object the retry path needs: messages dead-lettered to it vanish."""
        return self.kind == "missing" and self.role in _RETRY_PATH

    @property
    def line(self) -> str:
        """One line for a human: what, which, and why it matters."""
        what = f"{self.object} {self.name}"
        if self.owner and self.role in _ROLE_NAMES:
            what += f" ({_ROLE_NAMES[self.role]} of {self.owner})"
        if self.kind == "missing":
            if self.drops_messages:
                return f"missing {what}: the broker drops the messages that should go there"
            return f"missing {what}"
        if self.kind == "different":
            return f"different {what}: {self.detail}"
        return f"misrouted {what}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "object": self.object,
            "name": self.name,
            "owner": self.owner,
            "role": self.role,
            "detail": self.detail,
            "drops_messages": self.drops_messages,
        }


@dataclass(frozen=True)
class Orphan:
    """A live object of ours for a queue the file no longer declares (diff.orphans)."""

    object: str  # queue | exchange | policy
    name: str
    owner: str  # the queue that left the file
    messages: int | None  # queues only
    detail: str

    @property
    def line(self) -> str:
        return f"{self.object} {self.name}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"object": self.object, "name": self.name, "owner": self.owner,
                "messages": self.messages, "detail": self.detail}


@dataclass(frozen=True)
class Status:
    vhost: str
    source: str
    queues: tuple[QueueStatus, ...]
    drift: tuple[Drift, ...]
    # Other policies that drop, expire or limit the messages of a queue of the file.
    policy_hazards: tuple[PolicyHazard, ...] = ()
    # One line per main queue some of whose queues live on one node of a cluster.
    placement_warnings: tuple[str, ...] = ()
    orphans: tuple[Orphan, ...] = ()

    @property
    def ok(self) -> bool:
        """No drift and no policy that drops, expires or limits messages. A replica down is a
        warning, not drift: the queue works while a majority of its replicas runs, and the file
        cannot fix it."""
        return not self.drift and not self.policy_hazards

    @property
    def hazard_lines(self) -> tuple[str, ...]:
        """One line per policy, key and kind of queue (broker/hazards.py)."""
        return tuple(hazard_lines(self.policy_hazards))

    @property
    def replica_warnings(self) -> tuple[str, ...]:
        """One line per quorum queue with a replica offline, or fewer than the file asks for."""
        return tuple(
            r.warning for row in self.queues for r in row.replicas if r.warning is not None
        )

    @property
    def policy_warnings(self) -> tuple[str, ...]:
        """One line per queue whose policy from the file loses to another, or ties with one."""
        return tuple(
            row.policy.warning for row in self.queues
            if row.policy is not None and row.policy.warning is not None
        )

    @property
    def orphan_warnings(self) -> tuple[str, ...]:
        """One line per object of ours for a queue the file no longer declares."""
        return tuple(f"orphan {o.line}" for o in self.orphans)

    @property
    def warnings(self) -> tuple[str, ...]:
        return (self.replica_warnings + self.policy_warnings + self.placement_warnings
                + self.orphan_warnings)

    def to_json(self) -> dict[str, Any]:
        return {
            "vhost": self.vhost,
            "file": self.source,
            "ok": self.ok,
            "warnings": list(self.warnings),
            "queues": [q.to_json() for q in self.queues],
            "drift": [d.to_json() for d in self.drift],
            "policy_hazards": [h.to_json() for h in self.policy_hazards],
            "policy_hazard_lines": list(self.hazard_lines),
            "orphans": [o.to_json() for o in self.orphans],
            # Every other count is read from the broker the moment status runs.
            "sampled": ["unacked", "held_for_dead_lettering", "online"],
        }


def _owner_and_role(change: Change, plan: Plan) -> tuple[str | None, str]:
    if change.renamed_to is not None:  # a rename migrate has yet to carry out
        return change.renamed_to, "rename"
    item = change.item
    if isinstance(item, Queue):
        return item.owner, item.role
    if isinstance(item, Exchange):
        return item.owner, item.role
    if isinstance(item, Binding):
        owner = {q.name: q.owner for q in plan.queues}.get(item.destination)
        on_retry_path = owner is not None and item.source == naming.retry_exchange(owner)
        return owner, "retry-binding" if on_retry_path else "binding"
    return None, change.object


def drift_of(changes: Iterable[Change], plan: Plan) -> tuple[Drift, ...]:
    """The changes that mean the broker is not what the file says, most dangerous first.

    ``prune``/``keep`` (old tiers still draining) are what a delay change leaves behind, not
    drift; ``unbind`` is, since an old first tier still bound would duplicate messages.
    """
    kinds: dict[str, DriftKind] = {
        "create": "missing",
        "conflict": "different",
        "migrate": "different",
        "unbind": "misrouted",
    }
    found = []
    for change in changes:
        kind = kinds.get(change.kind)
        if kind is None:
            continue
        owner, role = _owner_and_role(change, plan)
        found.append(Drift(kind, change.object, change.name, owner, role, change.detail))
    ordered = sorted(
        enumerate(found),
        key=lambda pair: (not pair[1].drops_messages, _KIND_ORDER[pair[1].kind], pair[0]),
    )
    return tuple(d for _, d in ordered)


def _tiers_of(main: str, live: LiveState) -> tuple[tuple[str, int], ...]:
    # Names under Q.retry. are reserved for Q's tiers (the loader refuses a queue named so).
    prefix = naming.tier_prefix(main)
    names = sorted(name for name in live.queues if name.startswith(prefix))
    return tuple((name, live.queues[name].messages) for name in names)


def _replicas_of(plan: Plan, main: str, live: LiveState) -> tuple[Replication, ...]:
    out = []
    for queue in plan.queues_of(main):
        live_queue = live.queues.get(queue.name)
        if live_queue is not None and live_queue.type == "quorum" and live_queue.members:
            out.append(replication_of(live_queue, queue, live.nodes))
    return tuple(out)


def _ordered_counts(
    plan: Plan, main: str, live: LiveState, retrying: int, parked: int | None,
    on_park: str | None,
) -> tuple[int, int, int, int] | None:
    """An ordered queue's ready and unacked messages over ``Q`` and its lanes, its held keys
    and held messages (see ``QueueStatus``); None for a plain queue."""
    lanes = [q.name for q in plan.queues_of(main) if q.role == "lane"]
    if not lanes:
        return None
    held = [q.name for q in plan.queues_of(main) if q.role == "held"]
    live_queues = [live.queues[n] for n in (main, *lanes) if n in live.queues]
    ready = sum(q.messages_ready for q in live_queues)
    unacked = sum(q.messages_unacknowledged for q in live_queues)
    back = live.queues[main].messages_ready if main in live.queues else 0
    keys = retrying + back + ((parked or 0) if on_park != "continue" else 0)
    waiting = sum(live.queues[n].messages for n in held if n in live.queues)
    return ready, unacked, keys, waiting


def build_status(
    plan: Plan, live: LiveState, changes: Sequence[Change], *, vhost: str, source: str,
    on_park: Mapping[str, str] | None = None,
) -> Status:
    """The status of every main queue of ``plan`` on ``live``; pure. ``on_park``: each ordered
    queue's ``on_park`` (default: hold)."""
    rows = []
    policies = applied_policies(plan, live)
    for main in plan.main_queues:
        live_main = live.queues.get(main.name)
        live_parking = live.queues.get(naming.parking_queue(main.name))
        tiers = _tiers_of(main.name, live)
        parked = live_parking.messages if live_parking else None
        ordered = _ordered_counts(plan, main.name, live, sum(n for _, n in tiers), parked,
                                  (on_park or {}).get(main.name))
        rows.append(
            QueueStatus(
                queue=main.name,
                ready=(ordered[0] if ordered else live_main.messages_ready)
                if live_main else None,
                unacked=(ordered[1] if ordered else live_main.messages_unacknowledged)
                if live_main else None,
                consumers=live_main.consumers if live_main else None,
                retrying=sum(n for _, n in tiers),
                parked=live_parking.messages if live_parking else None,
                tiers=tiers,
                held=tuple(
                    (name, live.queues[name].messages_dlx)
                    for name in (main.name, *(t for t, _ in tiers))
                    if name in live.queues and live.queues[name].messages_dlx
                ),
                replicas=_replicas_of(plan, main.name, live),
                policy=policies.get(main.name),
                held_keys=ordered[2] if ordered else None,
                held_messages=ordered[3] if ordered else None,
            )
        )
        rows[-1] = _with_stranded(rows[-1], plan, changes)
    return Status(vhost, source, tuple(rows), drift_of(changes, plan),
                  policy_hazards=tuple(policy_hazards(plan, live)),
                  placement_warnings=tuple(single_node_notes(plan, live)),
                  orphans=orphans_of(changes, live))


def orphans_of(changes: Iterable[Change], live: LiveState) -> tuple[Orphan, ...]:
    """The orphans among ``changes``, with the message count of each queue."""
    return tuple(
        Orphan(c.object, c.name, c.owner or "",
               live.queues[c.name].messages if c.object == "queue" and c.name in live.queues
               else None, c.detail)
        for c in changes if c.orphan
    )


def read_status(api: Management, settings: Settings, plan: Plan, source: str,
                on_park: Mapping[str, str] | None = None) -> Status:
    """The status now: objects and unacked counts from the management API, ready and consumer
    counts of every queue read exactly over AMQP."""
    live = read_live(api, settings.vhost)
    exact = asyncio.run(ready_and_consumers(settings, sorted(live.queues)))
    live = with_exact_counts(live, exact)
    return build_status(plan, live, diff(plan, live), vhost=settings.vhost, source=source,
                        on_park=on_park)


def _replicas_view(status: Status) -> list[RenderableType]:
    """The leader and replicas of every quorum queue, when there is more than one node to tell
    apart (or something to warn about); the warnings below, one line each."""
    replicas = [r for row in status.queues for r in row.replicas]
    if not any(len(r.members) > 1 or r.warning for r in replicas):
        return []
    table = new_table(title="quorum queues")
    for column in ("queue", "leader", "online", "replicas"):
        table.add_column(column, justify="right" if column == "online" else "left")
    for r in replicas:
        online = f"{len(r.online)}/{len(r.members)}"
        table.add_row(
            cell(r.queue),
            cell(r.leader),
            Text(online, style="bold yellow") if r.warning else cell(online),
            cell(", ".join(m if m in r.online else f"{m} (down)" for m in r.members)),
        )
    parts: list[RenderableType] = [table]
    for warning in status.replica_warnings:
        parts.append(Text(f"WARNING: {warning}", style="bold yellow"))
    return parts


def _policy_cell(applied: AppliedPolicy) -> str:
    if applied.policy is None and not applied.top:
        return "-"
    if applied.policy is None:
        names = ", ".join(p.name for p in applied.top)
        return f"one of {names} (priority {applied.top[0].priority}; the broker picks)"
    keys = ", ".join(f"{k}: {v}" for k, v in sorted(applied.policy.definition.items()))
    return f"{applied.policy.name} (priority {applied.policy.priority}; {keys or 'no keys'})"


def _policies_view(status: Status) -> list[RenderableType]:
    """The policy that applies to each queue, when any queue has one (or the file gives one);
    the warnings below, one line each."""
    rows = [row for row in status.queues if row.policy is not None]
    if not any(r.policy.top or r.policy.operator or r.policy.ours for r in rows if r.policy):
        return []
    table = new_table(title="policies")
    for column in ("queue", "policy that applies", "operator policy", "file's policy"):
        table.add_column(column)
    for row in rows:
        applied = row.policy
        assert applied is not None
        operator = applied.operator
        if applied.ours is None:
            ours = "-"
        elif applied.ours_live is None:
            ours = f"{applied.ours}: not on the broker"
        else:
            ours = f"{applied.ours}: " + ("applies" if applied.ours_applies else "does not apply")
        table.add_row(
            cell(row.queue),
            cell(_policy_cell(applied)),
            cell(f"{operator.name} (merged: lower limits win)" if operator else "-"),
            Text(ours, style="bold yellow") if applied.warning else cell(ours),
        )
    parts: list[RenderableType] = [table]
    for warning in status.policy_warnings:
        parts.append(Text(f"WARNING: {warning}", style="bold yellow"))
    return parts


def status_view(status: Status) -> RenderableType:
    """What ``rabbit-retry status`` prints: drift first, then a row per main queue."""
    parts: list[RenderableType] = [*_drift_view(status), *_hazards_view(status)]
    parts.append(_queues_table(status))
    parts.append(Text(SAMPLED_NOTE, style="dim"))
    parts.extend(_replicas_view(status))
    parts.extend(_policies_view(status))
    parts.extend(Text(f"WARNING: {w}", style="bold yellow") for w in status.placement_warnings)
    for row in status.queues:
        parts.extend(Text(line, style="bold yellow") for line in held_lines(row, status.source))
    if status.orphans:
        parts.append(Text(
            f"ORPHANS: {plural(len(status.orphans), 'object')} of queues no longer in "
            f"{status.source}; `rabbit-retry apply {status.source} --prune --target QUEUE` "
            "deletes those of QUEUE once empty", style="bold yellow"))
        parts.extend(Text("  " + o.line, style="yellow") for o in status.orphans)
    if not status.drift and status.policy_hazards:
        parts.append(Text(f"not safe: the broker has every object {status.source} derives, but "
                          "other policies drop, expire or limit their messages (above)",
                          style="bold red"))
    elif not status.drift:
        parts.append(Text(f"no drift: the broker has every object {status.source} derives",
                          style="green"))
    return Group(*parts)


def _drift_view(status: Status) -> list[RenderableType]:
    if not status.drift:
        return []
    parts: list[RenderableType] = [Text(
        f"DRIFT: {plural(len(status.drift), 'object')} of {status.source} missing or "
        f"different on the broker; `rabbit-retry plan {status.source}` shows the fix",
        style="bold red",
    )]
    for drift in status.drift:
        style = "bold red" if drift.drops_messages else (
            "red" if drift.kind == "missing" else "yellow"
        )
        parts.append(Text("  " + drift.line, style=style))
    parts.append(Text(""))
    return parts


def _hazards_view(status: Status) -> list[RenderableType]:
    if not status.policy_hazards:
        return []
    return [
        Text(
            f"POLICIES: other policies on the broker drop, expire or limit the messages of "
            f"{plural(len({h.queue for h in status.policy_hazards}), 'queue')} of "
            f"{status.source}; change or narrow them (the file cannot)",
            style="bold red",
        ),
        *(Text("  " + line, style="red") for line in status.hazard_lines),
        Text(""),
    ]


def _queues_table(status: Status) -> RenderableType:
    """A row per main queue (with its held keys, where a queue is ordered)."""
    table = new_table(title=f"vhost {status.vhost}")
    table.add_column("queue")
    ordered = any(row.held_keys is not None for row in status.queues)
    columns = ("ready", "unacked", "consumers", "retrying", "parked")
    for column in (*columns, *(("held keys", "held messages") if ordered else ())):
        table.add_column(column, justify="right")
    for row in status.queues:
        cells: list[Text | str] = [
            cell(row.queue),
            cell(row.ready),
            cell(row.unacked),
            cell(row.consumers),
            cell(row.retrying),
            Text(str(row.parked), style="bold yellow") if row.parked else cell(row.parked),
        ]
        if ordered:
            cells += [Text(str(row.held_keys), style="bold yellow") if row.held_keys
                      else cell(row.held_keys), cell(row.held_messages)]
        table.add_row(*cells)
    return table


# --- messages the broker holds for dead-lettering -----------------------------------------------


def _with_stranded(row: QueueStatus, plan: Plan, changes: Sequence[Change]) -> QueueStatus:
    """``row`` with ``stranded``: when every object of its queue's retry path exists, what holds
    its messages for dead-lettering is RabbitMQ's dead-letter cycle check, not a missing queue
    (docs/versions.md, "Stranded messages")."""
    if not row.held or row.ready is None:
        return row
    if any(c.kind == "create" and _owner_and_role(c, plan)[0] == row.queue for c in changes):
        return row
    return dataclasses.replace(row, stranded=tuple(name for name, _ in row.held))


def held_lines(row: QueueStatus, source: str) -> list[str]:
    """One line per queue of ``row`` holding messages for dead-lettering: why, and what to do."""
    lines = []
    for name, count in row.held:
        messages = plural(count, "message")
        if name not in row.stranded:
            lines.append(
                f"{name}: {messages} held by the broker for dead-lettering: the queue they go to "
                f"next is missing; `rabbit-retry apply {source}` recreates it and the broker "
                "hands them on (it retries every 3 minutes)"
            )
            continue
        way_out = (
            f"`rabbit-retry rescue {source} {row.queue}` parks them (it changes "
            f"{naming.retry_exchange(row.queue)}'s bindings for up to 6 minutes)"
            if name == row.queue else "no command can move them out"
        )
        lines.append(
            f"{name}: {messages} stranded by RabbitMQ's dead-letter cycle check: they reached "
            f"{row.queue}'s delivery limit without a verdict from the worker (another consumer "
            "requeued them, or they were returned while no worker ran) and the broker will not "
            f"dead-letter them on; {way_out} (docs/versions.md, \"Stranded messages\"); "
            "purging or deleting the queue deletes them"
        )
    return lines
