"""Reading a parking queue without changing it: ``show``, ``export`` and the count a
confirmation prompt shows."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rabbit_retry.errors import InputError
from rabbit_retry.parking.filters import Selection
from rabbit_retry.parking.message import ParkedMessage, export_record
from rabbit_retry.parking.session import Target, management_kind_of, open_parking
from rabbit_retry.settings import Settings


@dataclass(frozen=True)
class Peeked:
    target: Target
    ready: int  # messages parked when we looked
    seen: int  # how many of them we read (fewer with --limit)


async def peek(
    settings: Settings,
    name: str,
    visit: Callable[[ParkedMessage], None],
    *,
    limit: int | None = None,
) -> Peeked:
    """Calls ``visit`` with each parked message from the head, up to ``limit``; every one of them
    is still parked, in the same order, when this returns."""
    async with open_parking(settings, name, kind_of=management_kind_of(settings)) as parking:
        while limit is None or parking.taken < limit:
            taken = await parking.take()
            if taken is None:
                break
            visit(taken.message)
        return Peeked(parking.target, parking.ready, parking.taken)


async def collect(
    settings: Settings, name: str, *, limit: int | None = None
) -> tuple[Peeked, list[ParkedMessage]]:
    messages: list[ParkedMessage] = []
    peeked = await peek(settings, name, messages.append, limit=limit)
    return peeked, messages


async def count_matching(
    settings: Settings, name: str, selection: Selection, *, limit: int | None = None
) -> tuple[Peeked, int]:
    """How many parked messages ``selection`` matches (at most ``limit``); changes nothing."""
    matching = 0

    def visit(message: ParkedMessage) -> None:
        nonlocal matching
        if (limit is None or matching < limit) and selection.matches(message.headers):
            matching += 1

    return await peek(settings, name, visit), matching


async def export(settings: Settings, name: str, stream: IO[str]) -> Peeked:
    """Writes a JSON line per parked message to ``stream``; every one of them stays parked."""

    def write(message: ParkedMessage) -> None:
        stream.write(json.dumps(export_record(message), ensure_ascii=False) + "\n")

    return await peek(settings, name, write)


@contextmanager
def atomic_output(out: str) -> Iterator[IO[str]]:
    """A text stream for ``--out``: ``-`` is stdout; a file appears whole or not at all (written
    beside its destination, renamed when the block succeeds, removed when it fails)."""
    if out == "-":
        yield sys.stdout
        return
    path = Path(out)
    if path.is_dir():
        raise InputError(f"--out {out}: is a directory")
    directory = path.parent
    if not directory.is_dir():
        raise InputError(f"--out {out}: directory {str(directory)!r} does not exist")
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            yield stream
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
