"""The operators' verbs: ``status`` and the ``parking`` group (show, replay, purge, export).

Exit codes (README, "Commands"): 0 done; 1 the broker is unreachable or failed, and for
``status``, drift or a policy that drops messages (so monitoring can alert on it); 2 bad
input, including a queue that does not exist on the broker (the name given is what is wrong)
and a replay or purge that has no terminal to confirm on and no ``--yes``; 3 the parking queue
is one looking could harm (parking/kinds.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click
from click.decorators import FC
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rabbit_retry.cli import Group, confirm, pass_settings, stdin_is_terminal
from rabbit_retry.errors import EXIT_CONFLICT, EXIT_RUNTIME, InputError
from rabbit_retry.parking import act, filters, peek, render
from rabbit_retry.parking.message import group, summary_record
from rabbit_retry.settings import Settings
from rabbit_retry.text import plural

if TYPE_CHECKING:
    from rabbit_retry.broker.management import Management
    from rabbit_retry.rescue import Work
    from rabbit_retry.topology import Plan

_PARKED = "parked message"  # the noun of every count below


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Piped output is for people reading logs, not an 80-column terminal: do not wrap cells.
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, soft_wrap=True)


def _selection(wheres: Sequence[str], older_than: str | None = None) -> filters.Selection:
    try:
        return filters.selection(wheres, older_than, now=datetime.now(UTC))
    except ValueError as exc:
        raise InputError(str(exc)) from None


_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.command()
@click.argument("file", type=click.Path(dir_okay=False), metavar="FILE")
@_json
@pass_settings
def status(settings: Settings, file: str, as_json: bool) -> None:
    """Per queue of FILE: ready, unacked, consumers, retrying, parked; then drift.

    Exits 1 when the broker lacks or differs from any object FILE derives (a missing tier or
    parking queue makes the broker drop messages silently), or when another policy drops,
    expires or limits the messages of any of its queues.
    """
    from rabbit_retry.broker.identity import check_same_broker
    from rabbit_retry.broker.management import Management
    from rabbit_retry.status import read_status, status_view
    from rabbit_retry.topology import compile_topology, load_topology

    topology = load_topology(file)
    plan = compile_topology(topology)
    with Management.for_settings(settings) as api:
        check_same_broker(settings, api)
        report = read_status(api, settings, plan, file, topology.on_park)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        _console().print(status_view(report))
    if not report.ok:
        sys.exit(EXIT_RUNTIME)


@click.group(cls=Group)
def parking() -> None:
    """Review parked messages: show, replay, purge, export.

    QUEUE names a main queue or its parking queue (orders or orders.parking).
    """


_queue = click.argument("queue", metavar="QUEUE")


def _limit(help: str) -> Callable[[FC], FC]:
    return click.option("--limit", type=click.IntRange(min=1), metavar="N", help=help)


_wheres = click.option("--where", "wheres", multiple=True, metavar="HEADER=VALUE",
                       help="Only messages whose header equals VALUE (as text); repeat to "
                       "require all.")
_yes = click.option("--yes", is_flag=True, help="Do not ask for confirmation.")


@parking.command(short_help="Peek at parked messages; they stay parked.")
@_queue
@_limit("Read at most N messages from the head.")
@_json
@click.option("--group", "grouped", is_flag=True,
              help="Only the counts by exception type and reason.")
@pass_settings
def show(settings: Settings, queue: str, limit: int | None, as_json: bool, grouped: bool) -> None:
    """Peek at the parked messages of QUEUE; they stay parked, in their order."""
    peeked, messages = asyncio.run(peek.collect(settings, queue, limit=limit))
    groups = group(messages)
    if as_json:
        out = {
            "queue": peeked.target.parking,
            "main_queue": peeked.target.main,
            "parked": peeked.ready,
            "shown": peeked.seen,
            "groups": groups.to_json(),
        }
        if not grouped:
            out["messages"] = [summary_record(m) for m in messages]
        click.echo(json.dumps(out, indent=2, ensure_ascii=False))
        return
    console = _console()
    console.print(render.show_heading(peeked.target.parking, peeked.ready, peeked.seen))
    if not messages:
        return
    if not grouped:
        console.print(render.messages_table(messages))
        console.print()
    console.print(render.groups_line(groups, peeked.seen, peeked.ready))
    console.print(render.groups_table(groups))


@contextmanager
def _progress(verb: str) -> Iterator[act.Progress | None]:
    """A progress bar on a terminal; nothing otherwise (logs want the summary line only)."""
    if not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("scanned"), TimeElapsedColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"{verb} 0", total=None)

        def update(scanned: int, acted: int, total: int) -> None:
            bar.update(task, completed=scanned, total=total, description=f"{verb} {acted}")

        yield update


def _confirm(
    settings: Settings,
    queue: str,
    selection: filters.Selection,
    limit: int | None,
    verb: str,
    yes: bool,
) -> int | None:
    """With ``--yes``: None (no cap). Otherwise how many messages the operator agreed to act on,
    after showing the count; refuses without a terminal, and returns 0 when nothing matches."""
    if yes:
        return None
    if not stdin_is_terminal():
        raise InputError(
            f"refusing to {verb} without confirmation: stdin is not a terminal; pass --yes"
        )
    peeked, matching = asyncio.run(peek.count_matching(settings, queue, selection, limit=limit))
    target = peeked.target
    if matching == 0:
        click.echo(f"nothing to {verb}: none of the {plural(peeked.ready, _PARKED)} in "
                   f"{target.parking!r} matches {selection.describe()}")
        return 0
    where = f" to {target.main!r}" if verb == "replay" else ""
    confirm(
        f"{verb.capitalize()} {matching} of {plural(peeked.ready, _PARKED)} in "
        f"{target.parking!r}{where} ({selection.describe()})?"
    )
    return matching


def _capped_limit(limit: int | None, confirmed: int | None) -> int | None:
    if confirmed is None:
        return limit
    return confirmed if limit is None else min(limit, confirmed)


@parking.command(short_help="Move parked messages back to their queue.")
@_queue
@_limit("Replay at most N messages.")
@_wheres
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), metavar="N",
              help="At most N messages a second.")
@click.option("--handle-again", is_flag=True,
              help="Handle them even if an idempotent consumer already handled their key.")
@_yes
@pass_settings
def replay(
    settings: Settings,
    queue: str,
    limit: int | None,
    wheres: tuple[str, ...],
    rate: float | None,
    handle_again: bool,
    yes: bool,
) -> None:
    """Move parked messages back to their main queue, headers reset and replay-count + 1.

    Each copy is confirmed by the broker before the parked original is removed; messages that do
    not match stay parked, in their order.
    """
    selection = _selection(wheres)
    confirmed = _confirm(settings, queue, selection, limit, "replay", yes)
    if confirmed == 0:
        return
    with _progress("replayed") as progress:
        outcome = asyncio.run(
            act.replay(settings, queue, selection, limit=_capped_limit(limit, confirmed), rate=rate,
                       progress=progress, handle_again=handle_again)
        )
    click.echo(
        f"replayed {outcome.acted} of {plural(outcome.ready, _PARKED)} from "
        f"{outcome.target.parking!r} to {outcome.target.main!r} ({selection.describe()}); "
        f"{outcome.left} left parked"
    )


@parking.command(short_help="Delete parked messages.")
@_queue
@_wheres
@click.option("--older-than", metavar="DURATION",
              help="Only messages parked longer ago than this (90m, 2d).")
@_yes
@pass_settings
def purge(
    settings: Settings, queue: str, wheres: tuple[str, ...], older_than: str | None, yes: bool
) -> None:
    """Delete parked messages for good; the ones that do not match stay parked, in order.

    Without a filter, deletes every message parked when it starts, one by one: one parked while
    you confirm is never deleted unseen.
    """
    selection = _selection(wheres, older_than)
    confirmed = _confirm(settings, queue, selection, None, "purge", yes)
    if confirmed == 0:
        return
    with _progress("deleted") as progress:
        outcome = asyncio.run(
            act.purge(settings, queue, selection, limit=confirmed, progress=progress)
        )
    click.echo(
        f"deleted {outcome.acted} of {plural(outcome.ready, _PARKED)} from "
        f"{outcome.target.parking!r} ({selection.describe()}); {outcome.left} left parked"
    )


@parking.command(short_help="Write parked messages to a JSON-lines file.")
@_queue
@click.option("--out", required=True, metavar="FILE.jsonl",
              help="Where to write a JSON line per message; - for stdout.")
@pass_settings
def export(settings: Settings, queue: str, out: str) -> None:
    """Write every parked message of QUEUE to a JSON-lines file; they stay parked.

    Each line has the properties, the headers and the body (UTF-8 text, or base64 when it is not
    text, as body_encoding says).
    """
    with peek.atomic_output(out) as stream:
        peeked = asyncio.run(peek.export(settings, queue, stream))
    click.echo(
        f"exported {plural(peeked.seen, _PARKED)} from {peeked.target.parking!r} to {out}; "
        "they stay parked",
        err=True,
    )


def _rescue_interval(value: str) -> float:
    from rabbit_retry.topology.durations import parse_duration

    try:
        return parse_duration(value, limit_ms=None) / 1000
    except ValueError as exc:
        raise InputError(f"--interval: {exc}") from None


@click.command()
@click.argument("file", type=click.Path(dir_okay=False), metavar="FILE")
@click.argument("queues", nargs=-1, metavar="[QUEUE]...")
@click.option("--dry-run", is_flag=True, help="Say what it would move and what it cannot.")
@click.option("--interval", default="3m", show_default=True, metavar="DURATION",
              help="How often the broker retries held dead letters (its "
              "dead_letter_worker_publisher_confirm_timeout); each wait gives up after it.")
@_yes
@pass_settings
def rescue(settings: Settings, file: str, queues: tuple[str, ...], dry_run: bool, interval: str,
           yes: bool) -> None:
    """Move the messages RabbitMQ's dead-letter cycle check holds in FILE's queues to parking.

    A message that reached a quorum queue's delivery limit without a verdict from the worker
    can be held for ever (docs/versions.md, "Stranded messages"). Those held in a main queue Q
    are parked in Q.parking (reason stranded), through a queue Q.rescue bound to Q.retry for up
    to two of the broker's retry intervals (6 minutes by default); Q.retry's bindings are put
    back as FILE has them, also when interrupted, and a second run finishes what one left.
    Those held in a tier cannot be moved: one line each, exit 3.
    """
    from rabbit_retry.broker.identity import check_same_broker
    from rabbit_retry.broker.management import Management
    from rabbit_retry.rescue import read_survey

    seconds = _rescue_interval(interval)
    plan, on_park = _rescue_plan(file, queues)
    with Management.for_settings(settings) as api:
        check_same_broker(settings, api)
        found = read_survey(api, settings, plan, file, queues, on_park)
        for line in found.cannot:
            click.echo(f"cannot: {line}")
        for work in found.work:
            click.echo(("would move " if dry_run else "") + work.line)
        if not found.work and not found.cannot:
            click.echo(f"nothing stranded in the queues of {file} on vhost {settings.vhost!r}")
        if found.work and not dry_run:
            _confirm_rescue(yes, len(found.work))
            _run_rescue(settings, api, found.work, file, seconds)
    if found.cannot:
        sys.exit(EXIT_CONFLICT)


def _rescue_plan(file: str, queues: Sequence[str]) -> tuple[Plan, dict[str, str]]:
    """FILE's plan and each ordered queue's ``on_park``; a QUEUE not in it is refused."""
    from rabbit_retry.topology import compile_topology, load_topology

    topology = load_topology(file)
    plan = compile_topology(topology)
    mains = {q.name for q in plan.main_queues}
    for name in queues:
        if name not in mains:
            raise InputError(f"QUEUE {name!r}: not a queue of {file}")
    return plan, topology.on_park


def _confirm_rescue(yes: bool, queues: int) -> None:
    if yes:
        return
    if not stdin_is_terminal():
        raise InputError("refusing to rescue without confirmation: stdin is not a terminal; "
                         "pass --yes")
    confirm(f"Rescue the stranded messages of {plural(queues, 'queue')} above?")


def _run_rescue(settings: Settings, api: Management, work: Sequence[Work], file: str,
                seconds: float) -> None:
    """One queue after the other, under the vhost's lock (no apply or migrate meanwhile)."""
    from rabbit_retry.broker.lock import VhostLock
    from rabbit_retry.rescue import rescue_queue

    say = functools.partial(click.echo, err=True)
    with VhostLock(settings, "rescue", file, 60.0, say):
        for item in work:
            outcome = asyncio.run(rescue_queue(settings, api, item, seconds, say))
            for line in outcome.lines(file):
                click.echo(line)


COMMANDS = {"status": status, "parking": parking, "rescue": rescue}
