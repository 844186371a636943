"""An operator's edit of a parked message before it is replayed (pure): the body and headers to
publish, and the change as the audit keeps it (a unified diff of the body, each header before
and after). The stored message is never changed; only its replayed copy carries the edit.

Headers the operator left as they were keep their exact AMQP values (types and widths); a
header given a new value takes the JSON value's AMQP type. Headers a replay strips (parking,
death and retry headers) are not offered and not accepted.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry import contract, wire
from rabbit_retry.desk.errors import DeskError
from rabbit_retry.desk.records import body_text, stored_body, stored_headers
from rabbit_retry.parking.message import jsonable

DIFF_LINES_MAX = 400
HEADER_NAME_MAX = 255
_JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class Edited:
    body: bytes
    headers: bytes  # the AMQP field table to publish (replay headers are added then)
    detail: dict[str, Any]


def editable_headers(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's headers an edit may change (those a replay keeps), as JSON values."""
    shown: dict[str, Any] = jsonable(stored_headers(row, contract.kept_on_replay))
    return shown


def edit(row: Mapping[str, Any], *, body: bytes | None,
         headers: Mapping[str, Any] | None) -> Edited:
    """The copy to publish for ``row`` with ``body`` and/or ``headers`` (the whole set of
    editable headers; None: unchanged); ``DeskError`` when nothing changes or a header cannot
    be sent."""
    original_body = stored_body(row)
    kept = stored_headers(row, contract.kept_on_replay)
    shown = editable_headers(row)
    new_headers = dict(kept)
    changes: list[dict[str, Any]] = []
    if headers is not None:
        for name, value in headers.items():
            if not name or len(name) > HEADER_NAME_MAX:
                raise DeskError(f"headers: a header name of 1 to {HEADER_NAME_MAX} characters, "
                                f"not {name[:40]!r}")
            if not contract.kept_on_replay(name):
                raise DeskError(f"headers: {name!r} is set by rabbit-retry and a replay removes "
                                "it; it cannot be edited")
            _check_value(name, value)
        for name in sorted(set(kept) | set(headers)):
            before = shown.get(name)
            if name not in headers:
                del new_headers[name]
                changes.append({"name": name, "before": before, "after": None})
            elif name not in kept or headers[name] != before:
                new_headers[name] = headers[name]
                changes.append({"name": name, "before": before, "after": headers[name]})
    new_body = original_body if body is None else body
    if new_body == original_body and not changes:
        raise DeskError("nothing changed: edit the body or a header (or replay it as it is)")
    try:
        table = wire.encode_table(new_headers)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DeskError(f"headers: cannot be sent as AMQP headers ({exc})") from None
    detail: dict[str, Any] = {"row": row["id"], "headers": changes,
                              "body": None if new_body == original_body
                              else body_diff(original_body, new_body)}
    return Edited(new_body, table, detail)


def _check_value(name: str, value: Any, depth: int = 0) -> None:
    if depth > 8:
        raise DeskError(f"headers: {name!r} is nested too deeply")
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, int) and not isinstance(value, bool) and not (
                -2**63 <= value < 2**63):
            raise DeskError(f"headers: {name!r}: a whole number of at most 64 bits")
        if isinstance(value, float) and not math.isfinite(value):
            raise DeskError(f"headers: {name!r}: not a finite number")
        return
    if isinstance(value, list):
        for item in value:
            _check_value(name, item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise DeskError(f"headers: {name!r}: table keys are text")
            _check_value(name, item, depth + 1)
        return
    raise DeskError(f"headers: {name!r}: text, a number, true/false, null, a list or an object")


def body_diff(before: bytes, after: bytes) -> str:
    """A unified diff of two text bodies (at most ``DIFF_LINES_MAX`` lines), or a line saying
    how a binary body changed."""
    old, new = body_text(before), body_text(after)
    if old is None or new is None:
        return (f"binary body: {len(before)} bytes (sha256 {_sha(before)}) -> {len(after)} "
                f"bytes (sha256 {_sha(after)})")
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "before", "after",
                                      lineterm="", n=2))
    if len(lines) > DIFF_LINES_MAX:
        lines = [*lines[:DIFF_LINES_MAX], f"... {len(lines) - DIFF_LINES_MAX} more lines"]
    return "\n".join(lines)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
