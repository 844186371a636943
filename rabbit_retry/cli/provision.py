"""The provisioner's verbs: ``validate``, ``plan``, ``apply`` and ``export``.

Each command loads the file (nothing touches the broker before the file is known to be good),
then hands over to the pure core and the broker modules; this module only prints.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from rabbit_retry.broker.counts import ready_and_consumers
from rabbit_retry.broker.declare import ApplyReport, apply_changes, unsendable, work_count
from rabbit_retry.broker.declare import Progress as Advance
from rabbit_retry.broker.diff import (
    Change,
    apply_work,
    blocking,
    capacity_problem,
    count,
    deferred_notes,
    diff,
    listed,
    new_quorum_queues,
    nothing_to_do,
    pending,
    policy_notes,
    refusal,
    select,
    unknown_targets,
)
from rabbit_retry.broker.evictions import (
    Eviction,
    dead_letter_routes,
    evictions,
    moved_in,
    recount,
    refilled,
)
from rabbit_retry.broker.hazards import hazard_lines, policy_hazards
from rabbit_retry.broker.identity import check_same_broker
from rabbit_retry.broker.inspect import LiveState, read_capacity, read_live, with_exact_counts
from rabbit_retry.broker.management import Management
from rabbit_retry.broker.placement import single_node_notes
from rabbit_retry.broker.policies import (
    apply_policies,
    around_routes,
    policy_refusal,
    policy_work,
)
from rabbit_retry.cli import confirm, pass_settings, stdin_is_terminal
from rabbit_retry.errors import EXIT_PENDING, BrokerError, ConflictError, InputError
from rabbit_retry.settings import Settings
from rabbit_retry.text import plural
from rabbit_retry.topology import Plan, compile_topology, load_topology, naming
from rabbit_retry.topology.export import to_definitions, to_mermaid
from rabbit_retry.topology.monitoring import to_alerts, to_grafana
from rabbit_retry.topology.plan import Policy
from rabbit_retry.topology.resolved import Topology

if TYPE_CHECKING:
    from rabbit_retry.broker.lane_changes import LaneChange
    from rabbit_retry.broker.migrate import Moved, Moving, Refilling
    from rabbit_retry.broker.migrate_plan import Migration, Rename
    from rabbit_retry.outbox.destinations import Destinations

_STYLE = {
    "create": "green",
    "unchanged": "dim",
    "update": "yellow",
    "conflict": "bold red",
    "migrate": "magenta",
    "unbind": "yellow",
    "prune": "yellow",
    "keep": "cyan",
    "grow": "yellow",
}


def _load(file: str) -> Plan:
    return compile_topology(load_topology(file))


def _read(
    settings: Settings, plan: Plan, targets: Sequence[str] = (), *, checked: bool = False
) -> tuple[list[Change], LiveState]:
    """The diff of ``plan`` (only the part ``targets`` need, when given) with the vhost.
    ``checked``: both URLs are known to reach the vhost on one broker (``_locked``)."""
    with Management.for_settings(settings) as api:
        if not checked:
            check_same_broker(settings, api)
        live = read_live(api, settings.vhost)
    unknown = unknown_targets(plan, live, targets)
    if unknown:
        raise InputError(
            f"--target {unknown[0]}: no queue {unknown[0]!r} in the file, nor one of ours left "
            f"on vhost {settings.vhost!r} by an earlier file; name a queue of the file"
        )
    selection = sorted(set(targets)) or None
    changes = diff(plan, live, targets=selection)
    # "migrate keeps its N messages", "N messages in it": N read exactly, not from statistics
    # seconds old (an orphan group is pruned only if every queue of it is empty).
    moving = [c.name for c in changes if c.kind == "migrate"]
    orphaned = [c.name for c in changes if c.orphan and c.object == "queue"]
    # A policy that may evict messages: how many, counted exactly too (broker/evictions.py).
    moving += [c.item.queue for c in changes
               if isinstance(c.item, Policy) and c.kind != "unchanged" and not c.orphan]
    if moving or orphaned:
        names = [n for m in moving for n in (m, naming.migrating_queue(m)) if n in live.queues]
        names += orphaned
        live = with_exact_counts(live, asyncio.run(ready_and_consumers(settings, names)))
        changes = diff(plan, live, targets=selection)
    return changes, live


# Checked before each change a locked run makes: raises once the vhost's lock is lost.
Guard = Callable[[], None]


def _unguarded() -> None:
    """A run without the lock (a dry run) has nothing to check."""


@contextmanager
def _locked(settings: Settings, verb: str, file: str, timeout: float) -> Iterator[Guard]:
    """The vhost's lock (broker/lock.py) for the block: one apply or migrate at a time; it
    gives the check the run makes before each change (the lock may be lost meanwhile). The
    URLs are checked first, so a wrong one is said as plan says it, not as a lock failure."""
    from rabbit_retry.broker.lock import VhostLock

    with Management.for_settings(settings) as api:
        check_same_broker(settings, api)  # a missing vhost is said here too
    with VhostLock(settings, verb, file, timeout,
                   lambda line: click.echo(line, err=True)) as lock:
        yield lock.check


def _notes(plan: Plan, live: LiveState) -> list[str]:
    notes = policy_notes(plan, live)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    for line in hazard_lines(policy_hazards(plan, live)):
        click.echo(f"warning: {line}", err=True)
    for line in single_node_notes(plan, live):
        click.echo(f"warning: {line}", err=True)
    return notes


def _plugin(settings: Settings, plan: Plan) -> str | None:
    """Why the broker cannot declare an ordered queue's lanes exchange, or None."""
    if not any(q.role == "lane" for q in plan.queues):
        return None
    from rabbit_retry.topology.compile import missing_plugin

    with Management.for_settings(settings) as api:
        offered = api.overview().get("exchange_types") or []
    return missing_plugin(plan, {str(t.get("name")) for t in offered if isinstance(t, dict)})


def _capacity(settings: Settings, changes: Sequence[Change], new_quorum: int | None = None
              ) -> str | None:
    """Why the broker cannot take the new quorum queues (RabbitMQ 3.x only), or None;
    ``new_quorum``: how many, when not the queues ``changes`` create."""
    if new_quorum is None:
        new_quorum = new_quorum_queues(changes)
    if not new_quorum:
        return None
    with Management.for_settings(settings) as api:
        capacity = read_capacity(api)
    if not capacity.readable and capacity.version.startswith("3."):
        click.echo(
            f"note: the open-file limit of RabbitMQ {capacity.version} for {new_quorum} new "
            "quorum queues is not checked: reading it needs the monitoring tag", err=True
        )
    return capacity_problem(capacity, new_quorum)


def _policy_rights(settings: Settings, changes: Sequence[Change]) -> str | None:
    """Why this user may not set the file's policies, or None."""
    if not policy_work(changes):
        return None
    with Management.for_settings(settings) as api:
        return policy_refusal(api, changes)


def _line(change: Change) -> str:
    detail = f"  ({change.detail})" if change.detail else ""
    return f"{change.kind:<9} {change.object:<8} {change.name}{detail}"


def _summary(changes: Sequence[Change], vhost: str) -> str:
    totals = count(changes)
    parts = [
        f"{totals['create']} to create",
        f"{totals['unchanged']} unchanged",
        f"{totals['update']} to update",
        f"{totals['conflict']} in conflict",
        f"{totals['migrate']} to migrate",
        f"{totals['unbind']} to unbind",
        f"{totals['prune']} to prune",
        f"{totals['keep']} obsolete but not empty",
    ]
    if totals["grow"]:
        parts.append(f"{totals['grow']} short of replicas")
    orphans = sum(1 for c in changes if c.orphan)
    if orphans:
        parts.append(f"{plural(orphans, 'object')} of queues no longer in the file among them "
                     "(apply --prune --target QUEUE deletes those of QUEUE)")
    return f"vhost {vhost!r}: " + ", ".join(parts)


def _print_changes(changes: Sequence[Change], vhost: str, *, everything: bool = False) -> None:
    """The changes (every object with ``everything``), then one line counting the unchanged
    ones left out, then the summary."""
    shown = [c for c in changes if everything or listed(c)]
    console = Console()
    if console.is_terminal:
        table = Table("change", "object", "name", "detail", box=None, pad_edge=False)
        for c in shown:
            style = _STYLE[c.kind]
            table.add_row(f"[{style}]{c.kind}[/]", c.object, c.name, c.detail)
        if shown:
            console.print(table)
    else:  # piped: one plain line per object, easy to grep
        for c in shown:
            click.echo(_line(c))
    hidden = len(changes) - len(shown)
    if hidden:
        click.echo(f"unchanged: {plural(hidden, 'object')} not listed (--all lists them)")
    click.echo(_summary(changes, vhost))


@contextmanager
def _progress(total: int, guard: Guard) -> Iterator[Advance]:
    """Told after each broker operation: checks the lock (``guard``) before the next one, and
    on a terminal advances a bar."""
    console = Console(stderr=True)
    if not console.is_terminal or total < 20:
        yield lambda _n: guard()
        return
    columns = (TextColumn("applying"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("apply", total=total)

        def advance(n: int) -> None:
            guard()
            bar.advance(task, n)

        yield advance


def _report(report: ApplyReport, changes: Sequence[Change], vhost: str, prune: bool) -> None:
    _report_work(report, changes, vhost, prune)
    done = {*report.pruned, *(n for n, _ in report.discarded), *(n for n, _ in report.kept),
            *(c.name for c in report.left)}
    for c in changes:
        if c.orphan and c.name not in done and c.object != "policy":
            click.echo(f"left {c.name} ({c.detail}); apply --prune --target {c.owner} deletes "
                       "it once empty")


def _report_work(report: ApplyReport, changes: Sequence[Change], vhost: str,
                 prune: bool) -> None:
    if report.created:
        made = {"exchange": 0, "queue": 0, "binding": 0, "policy": 0}
        for c in report.created:
            made[c.object] += 1
        click.echo(
            f"created {plural(made['exchange'], 'exchange')}, {plural(made['queue'], 'queue')}"
            f" and {plural(made['binding'], 'binding')} in vhost {vhost!r}"
        )
    for c in report.unbound:
        click.echo(f"unbound {c.name}: {c.detail}")
    if prune:
        _report_grow(changes)
        for name in report.pruned:
            click.echo(f"pruned {name} (obsolete, empty)")
        for name, left in report.discarded:
            click.echo(f"pruned {name} and the {plural(left, 'message')} in it "
                       "(--discard-messages)")
        for name, left in report.kept:
            click.echo(
                f"kept {name} (obsolete, {plural(left, 'message')} still in it); prune again "
                "once it has drained"
            )
        for c in report.left:
            click.echo(f"left {c.name} ({c.detail}); apply --prune deletes it once its group "
                       "is empty, --discard-messages with what it holds")
        return
    for c in changes:
        if c.kind in ("prune", "keep") and not c.orphan:
            click.echo(f"left {c.name} ({c.detail}); apply --prune deletes it once empty")
    _report_grow(changes)


def _report_grow(changes: Sequence[Change]) -> None:
    for c in changes:
        if c.kind == "grow":
            click.echo(f"left {c.name} short of replicas: {c.detail}")


_file = click.argument("file", metavar="FILE")


@click.command()
@_file
def validate(file: str) -> None:
    """Check FILE and print what it would create; touches no broker."""
    compiled = _load(file)
    click.echo(
        f"{file}: valid; {plural(len(compiled.exchanges), 'exchange')}, "
        f"{plural(len(compiled.queues), 'queue')}, {plural(len(compiled.bindings), 'binding')}"
    )
    for c in diff(compiled, LiveState.empty()):
        click.echo(f"  {c.object:<8} {c.name}" + (f"  ({c.detail})" if c.detail else ""))
    click.echo(_destinations(compiled, file).describe())


def _destinations(compiled: Plan, file: str) -> Destinations:
    """Where ``Outbox.add`` may send an event, for this file (README, "The outbox")."""
    from rabbit_retry.outbox.destinations import Destinations

    return Destinations.of_plan(compiled, file)


_targets = click.option(
    "--target", "targets", multiple=True, metavar="QUEUE",
    help="Only this queue of FILE: the objects it compiles to, the bindings that feed it and "
    "their exchanges (or the objects of a queue no longer in FILE); repeat for more. A "
    "conflict elsewhere does not stop it.",
)
_lock_timeout = click.option(
    "--lock-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
    metavar="SECONDS",
    help="How long to wait for another apply or migrate on the vhost to finish; 0: refuse "
    "at once.",
)
# The document `plan --json` prints; README, "Commands", lists its fields. A field is only
# ever added; one renamed or removed raises the version.
PLAN_FORMAT = 1


@click.command()
@_file
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every object).")
@click.option("--all", "everything", is_flag=True,
              help="List unchanged objects too (by default only changes, and their count).")
@click.option("--detailed-exitcode", is_flag=True,
              help=f"Exit {EXIT_PENDING} when apply has changes to make, 0 when in sync.")
@click.option("--prune", is_flag=True,
              help="Plan for apply --prune: what it would delete counts as a change.")
@_targets
@pass_settings
def plan(settings: Settings, file: str, as_json: bool, everything: bool,
         detailed_exitcode: bool, prune: bool, targets: tuple[str, ...]) -> None:
    """Compare FILE with the live broker; exit 3 if anything conflicts.

    With --detailed-exitcode: 0 in sync, 4 changes pending, 3 conflict, 2 bad input,
    1 failure.
    """
    compiled = _load(file)
    destinations = _destinations(compiled, file)
    changes, live = _read(settings, compiled, targets)
    waiting = pending(apply_work(changes, targeted=bool(targets)), prune=prune)
    part = select(compiled, targets) if targets else compiled
    evicted = [*evictions(part, live), *_renaming(part, live, changes)]
    if as_json:
        document = {
            "format": PLAN_FORMAT,
            "file": file,
            "vhost": settings.vhost,
            "targets": sorted(set(targets)),
            "pending": waiting,
            "summary": count(changes),
            "changes": [c.to_json() for c in changes],
            "policy_notes": policy_notes(compiled, live),
            "policy_hazards": [h.to_json() for h in policy_hazards(compiled, live)],
            "evictions": [e.to_json() for e in evicted],
            "outbox_destinations": {"exchanges": sorted(destinations.exchanges),
                                    "queues": sorted(destinations.queues)},
        }
        click.echo(json.dumps(document, indent=2, sort_keys=True))
    else:
        _print_changes(changes, settings.vhost, everything=everything)
        _notes(compiled, live)
        _print_evictions(evicted)
    totals = count(changes)
    if totals["conflict"]:
        raise ConflictError(
            f"{totals['conflict']} object(s) conflict with {file}; apply would refuse"
        )
    for line in deferred_notes(changes, file):
        click.echo(line, err=True)
    if why := _migrations_needed(changes, file):
        raise ConflictError(why)
    if detailed_exitcode and waiting:
        sys.stdout.flush()
        sys.exit(EXIT_PENDING)


def _migrations_needed(changes: Sequence[Change], file: str) -> str | None:
    """What ``plan`` says when ``apply`` would refuse for a queue ``migrate`` must rebuild or
    give more or fewer lanes; None when none must."""
    rebuilt = sum(1 for c in changes if c.kind == "migrate" and blocking(c) and not c.lanes)
    more = sum(1 for c in changes if c.kind == "migrate" and c.lanes and c.lanes[1] > c.lanes[0])
    fewer = sum(1 for c in changes if c.kind == "migrate" and c.lanes and c.lanes[1] < c.lanes[0])
    laned = more + fewer
    if not (rebuilt or laned):
        return None
    what = [f"{plural(rebuilt, 'queue')} must be rebuilt to match {file} (the broker "
            "cannot change them in place)"] if rebuilt else []
    what += [f"{plural(more, 'ordered queue')} must get more lanes"] if more else []
    what += [f"{plural(fewer, 'ordered queue')} must get fewer lanes"] if fewer else []
    return (f"{'; '.join(what)}; apply would refuse; `rabbit-retry migrate {file}` does it and "
            "keeps their messages" + (" and each key's order" if laned else ""))


def _renaming(plan: Plan, live: LiveState, changes: Sequence[Change]) -> list[Eviction]:
    """The evictions the renames of ``changes`` make when ``migrate`` moves their messages."""
    from rabbit_retry.broker.migrate_plan import plan_renames

    return [e for r in plan_renames(changes, live) for e in moved_in(plan, live, r.old, r.moves)]


def _print_evictions(evicted: Sequence[Eviction]) -> None:
    for eviction in evicted:
        click.echo(eviction.line())
    if any(not e.moved_from for e in evicted):
        click.echo("apply makes a change that evicts messages only with --accept-evictions")
    if any(e.moved_from and not e.refused for e in evicted):
        click.echo("migrate moves a renamed queue's messages where they evict others only with "
                   "--accept-evictions")
    if any(e.refused for e in evicted):
        click.echo("migrate refuses a rename whose new queue would refuse the messages moved "
                   "in, with --accept-evictions too")


def _evictions_refused(evicted: Sequence[Eviction], accepted: bool) -> str | None:
    """Why ``apply`` will not evict messages without ``--accept-evictions``, or None; why
    ``migrate`` will not move a renamed queue's messages into a queue that refuses them, with
    it too."""
    refused = [e for e in evicted if e.refused]
    if refused:
        return "\n".join([*(f"queue {e.queue}: {e.detail}" for e in refused),
                          f"nothing was changed; {_make_room(e.queue for e in refused)}"])
    if accepted or not evicted:
        return None
    lines = [f"queue {e.queue}: {e.detail}" for e in evicted]
    return "\n".join([*lines, _nothing_changed(len(evicted) > 1)])


def _nothing_changed(many: bool) -> str:
    """How a refusal to evict ends when ``migrate`` or ``apply`` changed nothing yet: ``many``,
    more than one queue would evict."""
    return ("nothing was changed; pass --accept-evictions to make "
            f"{'these changes' if many else 'this change'}")


def _make_room(queues: Iterable[str]) -> str:
    """What makes a queue that refuses a rename's moved messages take them."""
    names = ", ".join(sorted(set(queues)))
    return (f"let the consumers of {names} make room, or raise its limit in the file and apply "
            "it, then run migrate again")


@click.command()
@_file
@click.option("--prune", is_flag=True,
              help="Delete obsolete retry tiers that are empty, and the objects of a queue no "
              "longer in FILE named by --target once they are empty.")
@click.option("--discard-messages", is_flag=True,
              help="With --prune: delete the objects of the queues no longer in FILE named by "
              "--target with their messages.")
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--accept-evictions", is_flag=True,
              help="Make changes that take messages out of a queue at once (a lowered length "
                   "limit, a new or shorter TTL): parked or dropped, as the file says.")
@_targets
@_lock_timeout
@pass_settings
def apply(settings: Settings, file: str, prune: bool, discard_messages: bool, dry_run: bool,
          accept_evictions: bool, targets: tuple[str, ...], lock_timeout: float) -> None:
    """Create what FILE needs on the broker; a second run changes nothing."""
    if discard_messages and not prune:
        raise InputError("--discard-messages: only with --prune")
    compiled = _load(file)
    if dry_run:
        _apply(settings, compiled, file, prune, discard_messages, True, targets,
               accept_evictions)
        return
    with _locked(settings, "apply", file, lock_timeout) as guard:
        _apply(settings, compiled, file, prune, discard_messages, False, targets,
               accept_evictions, guard)


def _apply(settings: Settings, compiled: Plan, file: str, prune: bool, discard: bool,
           dry_run: bool, targets: Sequence[str], accept_evictions: bool,
           guard: Guard = _unguarded) -> None:
    changes, live = _read(settings, compiled, targets, checked=not dry_run)
    refused = refusal(changes, settings.vhost, file)
    if refused:
        raise ConflictError("\n".join(refused))
    part = select(compiled, targets) if targets else compiled
    evicted = evictions(part, live)  # only what this apply changes: the targeted part
    if not dry_run and (why := _evictions_refused(evicted, accept_evictions)):
        raise ConflictError(why)
    names = unsendable(changes)
    if names:
        raise InputError("\n".join([*names, "nothing was changed"]))
    problem = (_plugin(settings, part) or _policy_rights(settings, changes)
               or _capacity(settings, changes))
    _notes(compiled, live)
    for line in deferred_notes(changes, file):
        click.echo(line, err=True)
    if dry_run:
        _print_changes(changes, settings.vhost)
        _print_evictions(evicted)
        if problem:
            click.echo(f"warning: apply would refuse: {problem}", err=True)
        click.echo("dry run: nothing was changed")
        return
    if problem:
        raise BrokerError(problem)
    work = apply_work(changes, targeted=bool(targets))
    if nothing_to_do(work, prune=prune):
        if any(c.kind == "migrate" for c in work):
            click.echo(f"nothing else to do in vhost {settings.vhost!r}")
        else:
            click.echo(f"nothing to do: vhost {settings.vhost!r} already matches {file}")
        _report(ApplyReport(), changes, settings.vhost, prune)
        return
    before, after = around_routes(compiled, work)  # never a limit without its route
    guard()
    evicted = _evicting(settings, part, live, before, accept_evictions)
    with Management.for_settings(settings) as api:
        done = apply_policies(api, settings.vhost, before)
    with _progress(work_count(work, prune=prune), guard) as advance:
        report = asyncio.run(
            apply_changes(settings, work, live.bindings, prune=prune, discard=discard,
                          progress=advance)
        )
    _report(report, changes, settings.vhost, prune)
    # An orphan's policy goes once its queues are gone (a policy removal is an update).
    gone = [replace(c, kind="update") for c in report.policies]
    guard()
    try:
        evicted += _evicting(settings, part, live, after, accept_evictions, changed=True)
    finally:
        for line in done:
            click.echo(line)
    with Management.for_settings(settings) as api:
        for line in apply_policies(api, settings.vhost, [*after, *gone]):
            click.echo(line)
    for eviction in evicted:  # accepted with --accept-evictions
        click.echo(eviction.done())


def _evicting(settings: Settings, part: Plan, live: LiveState, changes: Sequence[Change],
              accepted: bool, *, changed: bool = False) -> list[Eviction]:
    """The evictions that setting the policies of ``changes`` makes, their queues counted
    exactly again just before: the count ``apply`` read first is seconds old, and what
    arrived since is evicted too (a limit that evicted nothing then may now). Without
    ``accepted``, such an eviction stops ``apply`` before these policies are set. What
    arrives between this count and the broker applying the policy (a few milliseconds) is
    not counted, which ``Eviction.done`` says. ``changed``: apply has changed the broker
    already (what it changed stays)."""
    queues = [c.item.queue for c in policy_work(changes) if isinstance(c.item, Policy)]
    return recount(
        part, live, _counted(settings, live, queues), accepted=accepted, verb="apply",
        then=lambda many: f"{'their policies were' if many else 'its policy was'} not set "
        f"({'what apply changed before stays' if changed else 'nothing was changed'}); "
        f"pass --accept-evictions to make {'these changes' if many else 'this change'}")


def _counted(settings: Settings, live: LiveState, queues: Sequence[str]
             ) -> dict[str, tuple[int, int]]:
    """queue -> (ready, consumers) now, for each of ``queues`` on the broker when read."""
    names = sorted(set(queues) & set(live.queues))
    return asyncio.run(ready_and_consumers(settings, names)) if names else {}


@click.command()
@_file
@click.option("--dry-run", is_flag=True, help="Print the steps; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--accept-evictions", is_flag=True,
              help="Rebuild a queue under a lower x-max-length than it holds: what does not fit "
                   "is parked or dropped, as the file says.")
@_targets
@_lock_timeout
@pass_settings
def migrate(settings: Settings, file: str, dry_run: bool, yes: bool,
            accept_evictions: bool, targets: tuple[str, ...], lock_timeout: float) -> None:
    """Rebuild every queue of FILE the broker cannot change in place, keeping its messages,
    and add or take away the lanes FILE gives an ordered queue, keeping each key's order.

    Each queue waits in a holding queue (QUEUE.migrating) while it is deleted and declared
    again; a run that was stopped at any point is finished by running migrate again.
    """
    topology = load_topology(file)
    if dry_run:
        _migrate(settings, topology, file, True, yes, targets, accept_evictions)
        return
    with _locked(settings, "migrate", file, lock_timeout) as guard:
        _migrate(settings, topology, file, False, yes, targets, accept_evictions, guard)


def _migrate(settings: Settings, topology: Topology, file: str, dry_run: bool, yes: bool,
             targets: Sequence[str], accept_evictions: bool, guard: Guard = _unguarded) -> None:
    from rabbit_retry.broker.lane_changes import describe, plan_lane_changes
    from rabbit_retry.broker.migrate_plan import plan_migrations, plan_renames

    compiled = compile_topology(topology)
    changes, live = _read(settings, compiled, targets, checked=not dry_run)
    migrations = plan_migrations(changes, live, compiled.bindings)
    renames = plan_renames(changes, live)
    lanes = plan_lane_changes(changes, compiled)
    if not migrations and not renames and not lanes:
        click.echo(f"nothing to migrate: no queue of {file} differs in vhost {settings.vhost!r}")
        return
    _say_migrations(migrations, renames)
    held = (_held_now(compiled, live, changes, topology.on_park, file, settings.vhost)
            if lanes else {})
    for lane_change in lanes:
        for line in describe(lane_change, held.get(lane_change.queue, (0, 0))):
            click.echo(line)
    if not _migrate_checked(settings, compiled, file, changes, live, migrations, renames,
                            dry_run=dry_run, accept_evictions=accept_evictions):
        return  # a dry run
    if not yes:
        if not stdin_is_terminal():
            raise InputError(
                "refusing to migrate without confirmation: stdin is not a terminal; pass --yes"
            )
        confirm(f"Migrate {plural(len(migrations) + len(lanes), 'queue')} in vhost "
                f"{settings.vhost!r}?")
    routes = dead_letter_routes(compiled, changes, {m.name for m in migrations})
    _recount_before_changes(settings, compiled, live, migrations, renames, accept_evictions)
    if routes:  # before a queue is refilled under a new limit: what overflows is never cycled
        asyncio.run(apply_changes(settings, routes, live.bindings))
        for change in routes:
            click.echo(f"{'bound' if change.kind == 'create' else 'unbound'} {change.name}"
                       if change.object == "binding" else f"declared {change.name}")
    recounts = _Recounts(compiled, live, accept_evictions)
    moved = _carry_out(settings, compiled, file, migrations, renames,
                       sorted(set(targets)) or None, guard, lanes, recounts.refilling,
                       recounts.moving)
    recounts.add_moved(renames, moved)
    for eviction in recounts.evicted:  # accepted with --accept-evictions
        click.echo(eviction.done(f"the messages of {eviction.moved_from} were moved"
                                 if eviction.moved_from else "the queue was refilled"))


def _recount_before_changes(settings: Settings, compiled: Plan, live: LiveState,
                            migrations: Sequence[Migration], renames: Sequence[Rename],
                            accepted: bool) -> None:
    """The evictions of the rebuilt queues and of each rename's moves, counted again before
    ``migrate`` changes anything: messages may have arrived while it asked. Without
    ``accepted``, one found stops it with nothing changed (as does a new queue that would
    refuse a rename's moved messages, whatever ``accepted`` says)."""
    recount(compiled, live, _counted(settings, live, [m.name for m in migrations]),
            accepted=accepted, verb="migrate", then=_nothing_changed)
    for renamed in renames:  # and so, for the same reason, are the queues of each rename
        _recount_moves(compiled, live, renamed,
                       _counted(settings, live, [q for m in renamed.moves for q in m]),
                       accepted=accepted, left="nothing was changed", then=_nothing_changed)


def _recount_moves(compiled: Plan, live: LiveState, renamed: Rename,
                   counts: Mapping[str, tuple[int, int]], *, accepted: bool, left: str,
                   then: Callable[[bool], str]) -> None:
    """The evictions that moving the messages of ``renamed`` makes, counted again from
    ``counts`` (``recount``), before ``migrate`` changes anything and again just before the
    first move. Without ``accepted``, one found stops ``migrate`` (``then`` says how to go
    on); a new queue that would refuse the moved messages stops it whatever ``accepted``
    says (``left``: what ``migrate`` has left as it was)."""
    recount(compiled, live, counts, accepted=accepted, verb="migrate",
            find=lambda now: moved_in(compiled, now, renamed.old, renamed.moves),
            then=then, stuck=lambda: f"{left}; {_make_room([renamed.new])}")


@dataclass
class _Recounts:
    """What ``migrate`` counts again while it runs (its ``refilling`` and ``moving``), from
    what ``live`` read: what arrived since is evicted too. Without ``accepted``, an eviction
    found there stops ``migrate``; with it, ``evicted`` gathers them, to be said at the end."""

    compiled: Plan
    live: LiveState
    accepted: bool
    evicted: list[Eviction] = field(default_factory=list)
    # Per old queue: the counts just before its moves.
    counted: dict[str, Mapping[str, tuple[int, int]]] = field(default_factory=dict)

    def refilling(self, name: str, ready: int) -> None:
        """Counted again just before ``name`` takes its messages back: what arrived while it
        was rebuilt waited in its holding queue and is evicted too."""
        self.evicted.extend(recount(
            self.compiled, refilled(self.live, name), {name: (ready, 0)},
            accepted=self.accepted, verb="migrate",
            then=lambda _: f"{name} is rebuilt and its messages wait in "
            f"{naming.migrating_queue(name)}; pass --accept-evictions and run migrate again "
            "to refill it"))

    def moving(self, renamed: Rename, counts: Mapping[str, tuple[int, int]]) -> None:
        """Counted again once nothing new reaches the old queue (unbound), just before its
        messages are moved: what arrived in it until then is moved, and evicts, too."""
        self.counted[renamed.old] = counts
        left = (f"{renamed.old} is unbound (new messages reach {renamed.new}) and keeps its "
                "messages")
        _recount_moves(self.compiled, self.live, renamed, counts, accepted=self.accepted,
                       left=left, then=lambda _: f"{left}; pass --accept-evictions and run "
                       "migrate again to move them")

    def add_moved(self, renames: Sequence[Rename], moved: Sequence[Moved]) -> None:
        """The evictions of the renames, once done, counted from what was moved, not what was
        counted: a message the new queue already held (same message_id and body: routed to
        both while both were bound) is not moved again."""
        for renamed, done in zip(renames, moved, strict=True):
            counts = {**self.counted.get(renamed.old, {}),
                      **{source: (done.by_source.get(source, 0), 0)
                         for source, _ in renamed.moves}}
            self.evicted += moved_in(self.compiled, with_exact_counts(self.live, counts),
                                     renamed.old, renamed.moves)


def _held_now(plan: Plan, live: LiveState, changes: Sequence[Change],
              on_park: Mapping[str, str], file: str, vhost: str) -> dict[str, tuple[int, int]]:
    """Per ordered queue with held keys: how many (as ``status`` counts them) and how many of
    them parked messages hold."""
    from rabbit_retry.status import build_status

    rows = build_status(plan, live, changes, vhost=vhost, source=file, on_park=on_park).queues
    return {row.queue: (row.held_keys, (row.parked or 0) if on_park[row.queue] == "hold" else 0)
            for row in rows if row.held_keys}


def _say_migrations(migrations: Sequence[Migration], renames: Sequence[Rename]) -> None:
    """What each migration and rename will do, and in which order."""
    from rabbit_retry.broker.migrate_plan import describe, describe_rename, schedule

    for migration in migrations:
        for line in describe(migration):
            click.echo(line)
    for renamed in renames:
        for line in describe_rename(renamed):
            click.echo(line)
    if migrations:
        order = [f"{m.name} ({steps[0]}..{steps[-1]})" for m, steps in schedule(migrations)]
        click.echo("order: " + ", ".join(order) + (", then the renames" if renames else ""))


def _migrate_checked(
    settings: Settings, compiled: Plan, file: str, changes: Sequence[Change], live: LiveState,
    migrations: Sequence[Migration], renames: Sequence[Rename], *, dry_run: bool,
    accept_evictions: bool,
) -> bool:
    """Refuse (raise) what must not run; a dry run says what would be refused instead and
    returns False. True: go on (the accepted evictions said)."""
    from rabbit_retry.broker.migrate_plan import hold_hazards
    from rabbit_retry.broker.migrate_plan import (
        new_quorum_queues as migrated_quorum_queues,
    )

    if (why := _rename_unready(compiled, live, renames, file)) and not dry_run:
        raise ConflictError(why)
    if why:
        click.echo(f"warning: migrate would refuse: {why}", err=True)
    hazards = hold_hazards(migrations, live.policies)
    if hazards:
        raise ConflictError("\n".join([*hazards, "nothing was changed"]))
    # The same open-file guard as apply's: a classic -> quorum migration adds quorum queues.
    problem = _capacity(settings, changes, migrated_quorum_queues(migrations, live))
    rebuilt = {m.name for m in migrations}
    evicted = [e for e in evictions(compiled, live) if e.queue in rebuilt]
    evicted += [e for r in renames for e in moved_in(compiled, live, r.old, r.moves)]
    if dry_run:
        _print_evictions(evicted)
        if problem:
            click.echo(f"warning: migrate would refuse: {problem}", err=True)
        click.echo("dry run: nothing was changed")
        return False
    if problem:
        raise BrokerError(problem)
    if why := _evictions_refused(evicted, accept_evictions):
        raise ConflictError(why)
    for eviction in evicted:  # accepted
        click.echo(f"evicting from {eviction.queue}: {eviction.detail}")
    return True


def _carry_out(settings: Settings, compiled: Plan, file: str, migrations: Sequence[Migration],
               renames: Sequence[Rename], selection: list[str] | None, guard: Guard,
               lanes: Sequence[LaneChange] = (), refilling: Refilling | None = None,
               moving: Moving | None = None) -> list[Moved]:
    """Run the confirmed migrations, then the renames, and say what ``apply`` has left. Each
    step is said as it starts: the lock is checked there (a migration stopped at any step is
    finished by the next run)."""
    from rabbit_retry.broker.migrate import migrate as run_migrations
    from rabbit_retry.broker.migrate import rename as run_renames

    def say(line: str) -> None:
        guard()
        click.echo(line)

    if migrations:
        outcomes = asyncio.run(run_migrations(settings, migrations, say=say,
                                              refilling=refilling))
        click.echo(
            f"migrated {plural(len(outcomes), 'queue')} in vhost {settings.vhost!r}: "
            + ", ".join(o.name for o in outcomes)
        )
    if lanes:
        from rabbit_retry.broker.lane_changes import change_lanes

        asyncio.run(change_lanes(settings, lanes, say=say))
        verb = "added" if all(c.after > c.before for c in lanes) else "changed"
        click.echo(f"{verb} lanes in vhost {settings.vhost!r}: " + ", ".join(
            f"{c.queue} ({c.before} -> {c.after})" for c in lanes))
    moved: list[Moved] = []
    if renames:
        moved = asyncio.run(run_renames(settings, renames, say=say, moving=moving))
        click.echo(
            f"renamed {plural(len(renames), 'queue')} in vhost {settings.vhost!r}: "
            + ", ".join(f"{r.old} -> {r.new} ({plural(m.moved, 'message')} moved)"
                        for r, m in zip(renames, moved, strict=True))
        )
    left = [c for c in diff(compiled, read_live_of(settings), targets=selection)
            if c.kind != "unchanged" and not c.orphan]
    if left:
        click.echo(f"`rabbit-retry apply {file}` has {plural(len(left), 'change')} left to make")
    return moved


def _rename_unready(
    compiled: Plan, live: LiveState, renames: Sequence[Rename], file: str
) -> str | None:
    """Why ``migrate`` cannot move a renamed queue's messages yet: the new queue's objects
    (queue, tiers, parking, bindings, policy) are ``apply``'s to make first, so that nothing
    routed to the new name meanwhile is lost; None when they are all there."""
    for renamed in renames:
        todo = [c for c in diff(compiled, live, targets=[renamed.new])
                if c.kind in ("create", "update", "conflict", "unbind") and not c.orphan]
        if todo:
            return (f"queue {renamed.old} -> {renamed.new}: {plural(len(todo), 'object')} of "
                    f"{renamed.new} not on the broker as the file says yet ({todo[0].object} "
                    f"{todo[0].name}, ...); run `rabbit-retry apply {file}` first; nothing "
                    "was changed")
    return None


def read_live_of(settings: Settings) -> LiveState:
    with Management.for_settings(settings) as api:
        return read_live(api, settings.vhost)


@click.command()
@_file
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["definitions", "mermaid", "alerts", "grafana"]),
    required=True,
    help="definitions: JSON for POST /api/definitions/{vhost}; mermaid: a diagram; "
    "alerts: Prometheus alerting rules; grafana: a dashboard JSON.",
)
@click.option("--out", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Write to a file.")
def export(file: str, fmt: str, out: str | None) -> None:
    """Print FILE as broker definitions JSON, a Mermaid diagram, Prometheus alerting rules or a
    Grafana dashboard for its queues; touches no broker."""
    compiled = _load(file)
    if fmt == "definitions":
        text = json.dumps(to_definitions(compiled), indent=2, sort_keys=True) + "\n"
    elif fmt == "alerts":
        text = to_alerts(compiled, destinations=_destinations(compiled, file).names)
    elif fmt == "grafana":
        text = to_grafana(compiled, title=f"rabbit-retry: {Path(file).stem}",
                          destinations=_destinations(compiled, file).names)
    else:
        text = to_mermaid(compiled).rstrip("\n") + "\n"
    if out is None:
        sys.stdout.write(text)
        return
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--out {out}: cannot write ({exc.strerror})") from None
    click.echo(f"wrote {out}", err=True)


COMMANDS = {"validate": validate, "plan": plan, "apply": apply, "migrate": migrate,
            "export": export}
