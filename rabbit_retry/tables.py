"""The tables operators read on a terminal, drawn one way: no outer edge, bold headers, and a
dash in a cell that has nothing to say."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def new_table(title: str | None = None) -> Table:
    return Table(title=title, show_edge=False, pad_edge=False, header_style="bold")


def cell(value: object) -> Text:
    # Text, never markup: a parked exception message may well contain [brackets].
    return Text("-" if value is None or value == "" else str(value))
