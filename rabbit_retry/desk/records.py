"""A parked delivery as a row of the desk's store, and a stored row back as the message a replay
publishes (pure).

The row keeps the message exactly: the body's bytes, the headers as the AMQP field table they
were delivered in (``headers_raw``, decoded by the same decoder the client uses, so a replay
publishes every value as it came), and the other properties. Readable copies (``headers`` as
JSON, ``body_text`` when the body is UTF-8) are what the page and the search read.

``digest`` identifies one parked copy: a desk killed between its commit and its ack gets the
same copy again, and the store's unique index on ``digest`` keeps it once. It covers the queue,
body, properties and headers, except the broker's return counters (``x-delivery-count``,
``x-acquired-count``), which change on every redelivery of the same copy. Every parked copy
carries a ``parked-id`` of its own (new at every park), so two parks of one message are two
rows even when body, headers and ``parked-at`` are alike to the millisecond.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pamqp import commands as spec

from rabbit_retry import contract, wire
from rabbit_retry.desk.groups import Grouping
from rabbit_retry.parking.headers import parked_at
from rabbit_retry.parking.message import jsonable

# Per-redelivery counters: the same copy delivered twice must have the same digest.
_UNSTABLE = contract.RETURN_COUNTERS
EXCEPTION_MESSAGE_MAX = 2000  # characters stored of an exception message (the worker writes less)
BUILT_IN = Grouping()


@dataclass(frozen=True, slots=True)
class Parked:
    """One parked copy as the store keeps it."""

    digest: str
    queue: str  # the main queue it was parked from
    message_id: str | None
    correlation_id: str | None
    reason: str | None
    exception_type: str | None
    exception_message: str | None
    attempts: int | None
    parked_at: datetime
    group: str
    pattern: str  # the exception message with its variable parts taken out (the group's)
    headers: dict[str, Any]  # JSON view
    headers_raw: bytes  # the AMQP field table, exact
    properties: dict[str, Any]  # JSON view of every set property but headers
    body: bytes
    replay_of: str | None = None  # the desk replay this copy came back from
    grouping: int = 0  # the generation of grouping rules ``group`` was computed under
    source: str = "parking"

    def group_row(self) -> dict[str, Any]:
        return {"id": self.group, "queue": self.queue, "reason": self.reason,
                "exception_type": self.exception_type, "pattern": self.pattern,
                "sample": self.exception_message}

    def row(self) -> dict[str, Any]:
        text = body_text(self.body)
        return {
            "digest": self.digest,
            "queue": self.queue,
            "message_id": self.message_id,
            "correlation_id": self.correlation_id,
            "status": "parked",
            "reason": self.reason,
            "exception_type": self.exception_type,
            "exception_message": self.exception_message,
            "attempts": self.attempts,
            "parked_at": self.parked_at,
            "group_id": self.group,
            "headers": self.headers,
            "headers_raw": self.headers_raw,
            "properties": self.properties,
            # A UTF-8 body is kept once, as text (searchable); any other body as bytes.
            "body_text": text,
            "body": None if text is not None else self.body,
            "replay_of": self.replay_of,
            "grouping": self.grouping,
            "source": self.source,
        }


def body_text(body: bytes) -> str | None:
    """The body as text when it is UTF-8 without NUL characters (PostgreSQL text holds none)."""
    if b"\x00" in body:
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _set_properties(properties: spec.Basic.Properties) -> dict[str, Any]:
    return {
        name: value
        for name in contract.PROPERTY_NAMES
        if (value := getattr(properties, name, None)) is not None
    }


def parked(
    queue: str, body: bytes, properties: spec.Basic.Properties, *, now: datetime,
    grouping: Grouping = BUILT_IN, generation: int = 0,
) -> Parked:
    """The row of a copy delivered from ``queue``'s parking queue at ``now``, grouped by
    ``grouping`` (generation ``generation`` of the store's rules)."""
    headers = dict(properties.headers or {})
    stable = {k: v for k, v in headers.items() if k not in _UNSTABLE}
    raw = wire.encode_table(stable)
    props = _set_properties(properties)
    json_props = jsonable(props)
    digest = hashlib.sha256()
    for part in (queue.encode(), raw, repr(sorted(json_props.items())).encode(), body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    exc_type = contract.header_text(headers.get(contract.EXCEPTION_TYPE))
    exc_message = contract.header_text(headers.get(contract.EXCEPTION_MESSAGE))
    if exc_message is not None:
        exc_message = exc_message[:EXCEPTION_MESSAGE_MAX]
    reason = contract.parked_reason(headers)
    group, pattern = grouping.group(queue, reason, exc_type, exc_message)
    replay_of = contract.header_text(headers.get(contract.REPLAY_ID))
    return Parked(
        digest=digest.hexdigest(),
        queue=queue,
        message_id=contract.header_text(props.get("message_id")),
        correlation_id=contract.header_text(props.get("correlation_id")),
        reason=reason,
        exception_type=exc_type,
        exception_message=exc_message,
        attempts=contract.as_count(headers.get(contract.RETRY_COUNT)),
        parked_at=parked_at(headers) or now.astimezone(UTC),
        group=group,
        pattern=pattern,
        headers=jsonable(stable),
        headers_raw=raw,
        properties=json_props,
        body=body,
        replay_of=replay_of[:32] if replay_of else None,
        grouping=generation,
    )


def generated_message_id(digest: str) -> str:
    """The message id a replay gives a stored copy that has none: made from the copy (its
    digest), so every replay of it, and every copy of it that parks again, carries the same
    one (marked ``message-id-generated``)."""
    return f"rr-{digest[:32]}"


def stored_body(row: Mapping[str, Any]) -> bytes:
    text = row.get("body_text")
    if text is not None:
        return str(text).encode("utf-8")
    return bytes(row.get("body") or b"")


def stored_headers(row: Mapping[str, Any],
                   keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The headers exactly as delivered (the inverse of ``wire.encode_table``); with ``keep``,
    only the names it accepts."""
    return wire.decode_table(bytes(row["headers_raw"]), keep)


def stored_properties(row: Mapping[str, Any],
                      keep: Callable[[str], bool] | None = None) -> spec.Basic.Properties:
    """The delivered properties (headers included, or those ``keep`` accepts) of a stored row."""
    values = dict(row.get("properties") or {})
    stamp = values.get("timestamp")
    if isinstance(stamp, str):
        values["timestamp"] = datetime.fromisoformat(stamp)
    return spec.Basic.Properties(headers=stored_headers(row, keep), **values)
