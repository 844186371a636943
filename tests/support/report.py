"""What a failed test's report shows besides the assertion: a fixture names, as the test
starts, how to tell what happened (the workers' logs, the browser's screen), and the report of
a failed call gets it, in the process that ran the test (so also under xdist, which sends the
report on before any fixture's teardown runs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

Section = tuple[str, str]  # a report section: its title, its text
NOTES = pytest.StashKey[list[Callable[[], list[Section]]]]()


def on_failure(item: pytest.Item, note: Callable[[], list[Section]]) -> None:
    """If ``item``'s call fails, its report gets the sections ``note()`` gives then."""
    item.stash.setdefault(NOTES, []).append(note)


def add_notes(item: pytest.Item, report: pytest.TestReport) -> None:
    for note in item.stash.get(NOTES, []):
        try:
            report.sections.extend(note())
        except Exception as exc:  # a note must never hide the failure it explains
            report.sections.append(("note failed", repr(exc)))
