"""What operators see on a terminal: tables of parked messages, their counts by cause, and the
status of a topology's queues; builds rich renderables, prints nothing itself."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rabbit_retry.parking import headers as h
from rabbit_retry.parking.message import Groups, ParkedMessage, preview
from rabbit_retry.status import Status
from rabbit_retry.text import plural

EXCEPTION_CHARS = 70


def _cell(value: object) -> Text:
    # Text, never markup: a parked exception message may well contain [brackets].
    return Text("-" if value is None or value == "" else str(value))


def messages_table(messages: Sequence[ParkedMessage]) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for column in ("#", "id", "parked at (UTC)", "reason", "exception", "attempts",
                   "routing key", "body"):
        table.add_column(column, justify="right" if column in ("#", "attempts") else "left")
    for message in messages:
        moment = message.parked_at
        exception = ": ".join(p for p in (message.exception_type, message.exception_message) if p)
        if len(exception) > EXCEPTION_CHARS:
            exception = exception[: EXCEPTION_CHARS - 1] + "…"
        table.add_row(
            _cell(message.position),
            _cell(message.message_id),
            _cell(moment.strftime("%Y-%m-%d %H:%M:%S") if moment else
                  h.header_text(message.headers.get(h.PARKED_AT))),
            _cell(message.reason),
            _cell(exception),
            _cell(message.attempts),
            _cell(h.header_text(message.headers.get(h.ORIGINAL_ROUTING_KEY))),
            _cell(preview(message.body, 40)),
        )
    return table


def groups_table(groups: Groups) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("count", justify="right")
    table.add_column("exception type")
    table.add_column("reason")
    for exc_type, reason, n in groups.by_cause:
        table.add_row(_cell(n), _cell(exc_type), _cell(reason))
    return table


def show_heading(parking: str, ready: int, seen: int) -> Text:
    if ready == 0:
        return Text(f"{parking} is empty: nothing is parked.")
    text = f"{parking}: {plural(ready, 'parked message')}"
    if seen < ready:
        text += f" (showing the first {seen})"
    return Text(text, style="bold")


def groups_line(groups: Groups, seen: int, ready: int) -> Text:
    scope = "all" if seen >= ready else f"the first {seen}"
    reasons = ", ".join(f"{n} {reason}" for reason, n in groups.by_reason)
    return Text(f"by cause, {scope}: {reasons}", style="bold")


def status_view(status: Status) -> RenderableType:
    parts: list[RenderableType] = []
    if status.drift:
        parts.append(
            Text(
                f"DRIFT: {plural(len(status.drift), 'object')} of {status.source} missing or "
                f"different on the broker; `rabbit-retry plan {status.source}` shows the fix",
                style="bold red",
            )
        )
        for drift in status.drift:
            style = "bold red" if drift.drops_messages else (
                "red" if drift.kind == "missing" else "yellow"
            )
            parts.append(Text("  " + drift.line, style=style))
        parts.append(Text(""))
    table = Table(title=f"vhost {status.vhost}", show_edge=False, pad_edge=False,
                  header_style="bold")
    table.add_column("queue")
    for column in ("ready", "unacked", "consumers", "retrying", "parked"):
        table.add_column(column, justify="right")
    for row in status.queues:
        table.add_row(
            _cell(row.queue),
            _cell(row.ready),
            _cell(row.unacked),
            _cell(row.consumers),
            _cell(row.retrying),
            Text(str(row.parked), style="bold yellow") if row.parked else _cell(row.parked),
        )
    parts.append(table)
    for row in status.queues:
        for name, count in row.held:
            parts.append(Text(
                f"{name}: {plural(count, 'message')} held by the broker for dead-lettering: it "
                "cannot hand them on (a missing next queue, or a dead-letter cycle after a "
                "delivery limit; see docs/versions.md)",
                style="bold yellow",
            ))
    if not status.drift:
        parts.append(Text(f"no drift: the broker has every object {status.source} derives",
                          style="green"))
    return Group(*parts)
