"""A parked message as plain values, and the views operators get of it (a row, a JSON line,
counts by cause); pure."""

from __future__ import annotations

import base64
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from rabbit_retry import contract
from rabbit_retry.parking.headers import parked_at

PREVIEW_CHARS = 60
@dataclass(frozen=True)
class ParkedMessage:
    """One message read from a parking queue; ``position`` counts from 1 at the queue's head."""

    position: int
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    properties: Mapping[str, Any] = field(default_factory=dict)  # PROPERTY_NAMES that are set

    def header(self, name: str) -> str | None:
        """Header ``name`` as text; None when the message does not carry it."""
        return contract.header_text(self.headers.get(name))

    @property
    def message_id(self) -> str | None:
        return contract.header_text(self.properties.get("message_id"))

    @property
    def message_id_generated(self) -> bool:
        """Whether ``message_id`` was made by rabbit-retry (the message came without one)."""
        return contract.as_flag(self.headers.get(contract.MESSAGE_ID_GENERATED))

    @property
    def correlation_id(self) -> str | None:
        return contract.header_text(self.properties.get("correlation_id"))

    @property
    def reason(self) -> str | None:
        return contract.parked_reason(self.headers)

    @property
    def exception_type(self) -> str | None:
        return self.header(contract.EXCEPTION_TYPE)

    @property
    def exception_message(self) -> str | None:
        return self.header(contract.EXCEPTION_MESSAGE)

    @property
    def attempts(self) -> int | None:
        return contract.as_count(self.headers.get(contract.RETRY_COUNT))

    @property
    def replay_count(self) -> int:
        return contract.as_count(self.headers.get(contract.REPLAY_COUNT)) or 0

    @property
    def parked_at(self) -> datetime | None:
        return parked_at(self.headers)


def jsonable(value: Any) -> Any:
    """A header or property value as JSON: bytes that are not UTF-8 become ``{"base64": ...}``,
    timestamps ISO-8601 strings, decimals strings; tables and arrays recursively."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {_name(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


def _name(key: object) -> str:
    # A header name that is not UTF-8 is decoded with surrogateescape (wire.py); JSON stores
    # (PostgreSQL's jsonb) refuse lone surrogates, so a view shows those bytes as U+FFFD.
    return str(key).encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def body_fields(body: bytes) -> dict[str, str]:
    """``body`` as UTF-8 text when it decodes, else base64, with the ``body_encoding`` used."""
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def decode_body(record: Mapping[str, Any]) -> bytes:
    """The bytes of an exported line's body (the inverse of ``body_fields``)."""
    text = str(record["body"])
    if record.get("body_encoding") == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


def preview(body: bytes, limit: int = PREVIEW_CHARS) -> str:
    """A one-line, terminal-safe glimpse of the body: text with control characters escaped, or
    ``<binary, N bytes> 0a1b...`` for anything that is not UTF-8."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        shown = body[: limit // 3].hex()
        more = "…" if len(body) > limit // 3 else ""
        return f"<binary, {len(body)} bytes> {shown}{more}"
    safe = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)
    return safe if len(safe) <= limit else safe[: limit - 1] + "…"


def export_record(message: ParkedMessage) -> dict[str, Any]:
    """One line of ``parking export``: everything needed to inspect or re-publish the message."""
    return {
        "position": message.position,
        "properties": {k: jsonable(v) for k, v in message.properties.items()},
        "headers": jsonable(dict(message.headers)),
        **body_fields(message.body),
    }


def summary_record(message: ParkedMessage) -> dict[str, Any]:
    """What ``parking show --json`` says about one message."""
    return {
        "position": message.position,
        "message_id": message.message_id,
        "message_id_generated": message.message_id_generated,
        "correlation_id": message.correlation_id,
        "parked_at": message.header(contract.PARKED_AT),  # as the worker wrote it
        "reason": message.reason,
        "exception_type": message.exception_type,
        "exception_message": message.exception_message,
        "attempts": message.attempts,
        "replay_count": message.replay_count,
        "original_exchange": message.header(contract.ORIGINAL_EXCHANGE),
        "original_routing_key": message.header(contract.ORIGINAL_ROUTING_KEY),
        "original_queue": message.header(contract.ORIGINAL_QUEUE),
        "body_bytes": len(message.body),
        "body_preview": preview(message.body),
    }


@dataclass(frozen=True)
class Groups:
    """How many of what: the first question on call."""

    by_cause: tuple[tuple[str, str, int], ...]  # (exception type, reason, count), largest first
    by_reason: tuple[tuple[str, int], ...]
    by_exception_type: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "by_cause": [
                {"exception_type": t, "reason": r, "count": n} for t, r, n in self.by_cause
            ],
            "by_reason": dict(self.by_reason),
            "by_exception_type": dict(self.by_exception_type),
        }


NONE = "(none)"


def _ranked(counter: Counter[Any]) -> list[tuple[Any, int]]:
    # Largest first; ties in a stable, readable order.
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))


def group(messages: Iterable[ParkedMessage]) -> Groups:
    causes: Counter[tuple[str, str]] = Counter()
    for message in messages:
        causes[(message.exception_type or NONE, message.reason or NONE)] += 1
    reasons: Counter[str] = Counter()
    types: Counter[str] = Counter()
    for (exc_type, reason), n in causes.items():
        reasons[reason] += n
        types[exc_type] += n
    return Groups(
        by_cause=tuple((t, r, n) for (t, r), n in _ranked(causes)),
        by_reason=tuple(_ranked(reasons)),
        by_exception_type=tuple(_ranked(types)),
    )
