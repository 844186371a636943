"""An event as ``Outbox.add`` writes it, and a stored row as the message the relay publishes
(pure, but for reading the trace context of the running application).

Everything that could make the broker refuse an event for what it is (a header value AMQP
cannot carry, a property of the wrong type, a routing key or message id longer than 255 bytes)
is refused here, in ``add``, before anything is written. Headers are stored as the AMQP field
table they go out as (``wire.encode_table``), so the relay publishes every value exactly as the
application gave it; the other properties as JSON.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rabbit_retry.outbox.destinations import MAX_SHORT_STRING
from rabbit_retry.wire import CopyProperties, decode_table, encode_table

MAX_KEY_BYTES = 1024  # an order key is indexed: far below what a PostgreSQL index entry allows
# The W3C trace context headers a propagator writes (the relay puts them on the message).
TRACE_HEADERS = ("traceparent", "tracestate")

# Message properties ``add`` takes, beside headers and message_id. ``user_id`` is not one: the
# broker refuses a user_id other than the relay's own user.
TEXT_PROPERTIES = ("content_type", "content_encoding", "correlation_id", "reply_to", "type",
                   "app_id")


@dataclass(frozen=True, slots=True)
class Event:
    """One event, as the columns ``add`` writes (``schema.ADDED``)."""

    exchange: str
    routing_key: str
    message_id: str
    order_key: str | None
    body: bytes
    headers: bytes | None  # the AMQP field table
    properties: str | None  # JSON
    trace: str | None  # JSON: traceparent / tracestate at add

    def row(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "routing_key": self.routing_key,
                "message_id": self.message_id, "order_key": self.order_key, "body": self.body,
                "headers": self.headers, "properties": self.properties, "trace": self.trace}


def make_event(exchange: str, routing_key: str, *, body: bytes | bytearray | memoryview | str,
               message_id: str | None, key: str | None, headers: Mapping[str, Any] | None,
               properties: Mapping[str, Any]) -> Event:
    """The event ``add`` writes, checked; ``ValueError`` / ``TypeError`` naming the argument."""
    return Event(
        exchange=exchange,
        routing_key=routing_key,
        message_id=_message_id(message_id),
        order_key=_key(key),
        body=_body(body),
        headers=_headers(headers),
        properties=_properties(properties),
        trace=None if headers and any(h in headers for h in TRACE_HEADERS) else trace_context(),
    )


def _message_id(value: str | None) -> str:
    if value is None:
        return uuid.uuid4().hex
    if not isinstance(value, str):
        raise TypeError(f"message_id: a str, got {type(value).__name__}")
    if not value or len(value.encode()) > MAX_SHORT_STRING:
        raise ValueError(f"message_id: 1 to {MAX_SHORT_STRING} bytes, got {len(value.encode())}")
    return value


def _key(value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"key: a str, got {type(value).__name__}")
    if not value or len(value.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"key: 1 to {MAX_KEY_BYTES} bytes, got {len(value.encode())}")
    return value


def _body(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"body: bytes or str, got {type(value).__name__}")


def _headers(value: Mapping[str, Any] | None) -> bytes | None:
    if not value:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"headers: a mapping, got {type(value).__name__}")
    for name in value:
        if not isinstance(name, str):
            raise TypeError(f"headers: names are str, got {name!r}")
    try:
        return encode_table(value)
    except TypeError as exc:
        raise TypeError(f"headers: {exc}") from None


def _properties(given: Mapping[str, Any]) -> str | None:
    out: dict[str, Any] = {}
    for name, value in given.items():
        if value is None:
            continue
        if name in TEXT_PROPERTIES:
            if not isinstance(value, str):
                raise TypeError(f"{name}: a str, got {type(value).__name__}")
            if len(value.encode()) > MAX_SHORT_STRING:
                raise ValueError(f"{name}: at most {MAX_SHORT_STRING} bytes")
            out[name] = value
        elif name == "delivery_mode":
            if value not in (1, 2) or isinstance(value, bool):
                raise ValueError(f"delivery_mode: 1 (transient) or 2 (persistent), got {value!r}")
            if value == 1:  # persistent is what the relay sends unless told
                out[name] = 1
        elif name == "priority":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
                raise ValueError(f"priority: an int from 0 to 255, got {value!r}")
            out[name] = value
        elif name == "expiration":
            out[name] = _expiration(value)
        elif name == "timestamp":
            out[name] = _timestamp(value)
        else:
            raise TypeError(f"unknown message property {name!r}")
    return json.dumps(out, sort_keys=True, separators=(",", ":")) if out else None


def _expiration(value: object) -> str:
    """A per-message TTL in milliseconds (AMQP carries it as a string of digits)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"expiration: milliseconds as an int or a str, got {type(value).__name__}")
    text = str(value)
    if not text.isascii() or not text.isdigit() or len(text) > 10:
        raise ValueError(f"expiration: whole milliseconds, got {value!r}")
    return text


def _timestamp(value: object) -> int:
    if isinstance(value, datetime):
        moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return int(moment.timestamp())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise TypeError(f"timestamp: a datetime or seconds since the epoch, got {value!r}")


def trace_context() -> str | None:
    """The running application's trace context as its OpenTelemetry propagator writes it
    (JSON), when the application uses OpenTelemetry; None otherwise. Never imports
    OpenTelemetry into an application that has not: without it there is nothing to carry."""
    if "opentelemetry" not in sys.modules:
        return None
    try:
        from opentelemetry.propagate import inject

        carrier: dict[str, str] = {}
        inject(carrier)
    except Exception:  # a broken propagator must not fail the application's transaction
        return None
    kept = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
    return json.dumps(kept, sort_keys=True, separators=(",", ":")) if kept else None


def outgoing(message_id: str, body: bytes, headers: bytes | None, properties: str | None,
             trace: str | None) -> tuple[bytes, CopyProperties]:
    """A stored event (its columns) as (body, properties) to publish: its headers exactly as
    added, the trace context of the add (``traceparent``, ``tracestate``) among them,
    persistent unless the event said otherwise."""
    table: dict[str, Any] = decode_table(bytes(headers)) if headers else {}
    if trace:
        for name, value in json.loads(trace).items():
            table.setdefault(name, value)
    given: dict[str, Any] = json.loads(properties) if properties else {}
    stamp = given.pop("timestamp", None)
    kind = given.pop("type", None)
    return bytes(body), CopyProperties(
        message_id=message_id,
        delivery_mode=given.pop("delivery_mode", 2),
        headers=table or None,
        timestamp=None if stamp is None else datetime.fromtimestamp(stamp, UTC),
        message_type=kind,
        **given,
    )
