"""The parking headers of product.md section 4, and what a replay does to them; pure."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

PARKED_REASON = "parked-reason"
PARKED_AT = "parked-at"
RETRY_COUNT = "retry-count"
REPLAY_COUNT = "replay-count"
EXCEPTION_TYPE = "exception-type"
EXCEPTION_MESSAGE = "exception-message"
EXCEPTION_STACKTRACE = "exception-stacktrace"
ORIGINAL_EXCHANGE = "original-exchange"
ORIGINAL_ROUTING_KEY = "original-routing-key"
ORIGINAL_QUEUE = "original-queue"

ORIGINAL_USER_ID = "original-user-id"

# What a replay removes: the broker's bookkeeping about earlier hops and everything parking
# added, so the replayed copy starts over with a clean count. original-exchange and
# original-routing-key stay: they say where the message was first published, and the worker
# reports them again (it reads them before anything else) if the replayed copy parks.
STRIPPED_ON_REPLAY = frozenset(
    {
        "x-death",
        "x-delivery-count",
        PARKED_REASON,
        PARKED_AT,
        RETRY_COUNT,
        EXCEPTION_TYPE,
        EXCEPTION_MESSAGE,
        EXCEPTION_STACKTRACE,
        ORIGINAL_QUEUE,
    }
)
STRIPPED_PREFIXES = ("x-first-death-", "x-last-death-")


def header_text(value: Any) -> str | None:
    """A header value as text, the way ``--where`` compares it; None for an absent value."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def as_count(value: Any) -> int | None:
    """A counter header as a non-negative int; None when absent or garbled."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float | Decimal):
        return int(value) if math.isfinite(value) and value >= 0 else None
    text = header_text(value)
    if text is not None and text.strip().isdigit():
        return int(text.strip())
    return None


def parked_at(headers: Mapping[str, Any]) -> datetime | None:
    """When the message was parked, as an aware UTC datetime; None if absent or unreadable."""
    value = headers.get(PARKED_AT)
    if isinstance(value, datetime):
        moment = value
    else:
        text = header_text(value)
        if not text:
            return None
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            return None
    if moment.tzinfo is None:  # ISO-8601 without an offset: the worker writes UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def replay_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headers of a replayed copy: parking and death headers stripped, retries reset,
    ``replay-count`` one more than before (a garbled one counts as 0)."""
    source = dict(headers or {})
    out = {
        key: value
        for key, value in source.items()
        if key not in STRIPPED_ON_REPLAY and not key.startswith(STRIPPED_PREFIXES)
    }
    out[REPLAY_COUNT] = (as_count(source.get(REPLAY_COUNT)) or 0) + 1
    return out
