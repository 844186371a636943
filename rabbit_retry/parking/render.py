"""What operators see of a parking queue on a terminal: its parked messages and their counts by
cause; builds rich renderables, prints nothing itself."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from rabbit_retry import contract
from rabbit_retry.parking.message import Groups, ParkedMessage, preview
from rabbit_retry.tables import cell, new_table
from rabbit_retry.text import plural

EXCEPTION_CHARS = 70


GENERATED = " (generated)"


def messages_table(messages: Sequence[ParkedMessage]) -> Table:
    """One row per message; a ``correlation id`` column when any of them has one (a Celery task
    is known by it: its message id is one rabbit-retry made up, marked ``(generated)``)."""
    correlated = any(m.correlation_id for m in messages)
    table = new_table()
    for column in ("#", "id", *(["correlation id"] if correlated else []), "parked at (UTC)",
                   "reason", "exception", "attempts", "routing key", "body"):
        table.add_column(column, justify="right" if column in ("#", "attempts") else "left")
    for message in messages:
        moment = message.parked_at
        exception = ": ".join(p for p in (message.exception_type, message.exception_message) if p)
        if len(exception) > EXCEPTION_CHARS:
            exception = exception[: EXCEPTION_CHARS - 1] + "…"
        ident = message.message_id
        if ident and message.message_id_generated:
            ident += GENERATED
        table.add_row(
            cell(message.position),
            cell(ident),
            *([cell(message.correlation_id)] if correlated else []),
            cell(moment.strftime("%Y-%m-%d %H:%M:%S") if moment else
                  message.header(contract.PARKED_AT)),
            cell(message.reason),
            cell(exception),
            cell(message.attempts),
            cell(message.header(contract.ORIGINAL_ROUTING_KEY)),
            cell(preview(message.body, 40)),
        )
    return table


def groups_table(groups: Groups) -> Table:
    table = new_table()
    table.add_column("count", justify="right")
    table.add_column("exception type")
    table.add_column("reason")
    for exc_type, reason, n in groups.by_cause:
        table.add_row(cell(n), cell(exc_type), cell(reason))
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
