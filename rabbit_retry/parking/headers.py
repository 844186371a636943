"""What the parking views read from a parked copy's headers, and what a replay does to them
(pure). The header names and counting rules are ``contract``'s."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pamqp import commands as spec

from rabbit_retry.contract import (
    HANDLE_AGAIN,
    ORIGINAL_EXPIRATION,
    PARKED_AT,
    REPLAY_COUNT,
    as_count,
    as_text,
    broker_parking,
    header_text,
    kept_on_replay,
    republish_properties,
)
from rabbit_retry.wire import CopyProperties


def parked_at(headers: Mapping[str, Any]) -> datetime | None:
    """When the message was parked, as an aware UTC datetime (parked by the broker: the time of
    that dead-lettering in ``x-death``); None if absent or unreadable."""
    value = headers.get(PARKED_AT)
    if value is None and (death := broker_parking(headers)) is not None:
        value = death.get("time")
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


def replay_headers(
    headers: Mapping[str, Any] | None, *, handle_again: bool = False
) -> dict[str, Any]:
    """The headers of a replayed copy: parking and death headers stripped, retries reset,
    ``replay-count`` one more than before (a garbled one counts as 0); with ``handle_again``,
    ``handle-again: true`` (an idempotent consumer runs it even if its key is done)."""
    source = dict(headers or {})
    out = {key: value for key, value in source.items() if kept_on_replay(key)}
    out[REPLAY_COUNT] = (as_count(source.get(REPLAY_COUNT)) or 0) + 1
    if handle_again:
        out[HANDLE_AGAIN] = True
    return out


def replay_properties(
    source: spec.Basic.Properties, user: str, *, handle_again: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> CopyProperties:
    """The properties of a replayed copy of a parked message (CLI and desk): ``replay_headers``
    plus ``extra``, published as ``user``; a per-message TTL the worker moved into
    ``original-expiration`` goes back to ``expiration`` (the header removed), so the replayed
    message expires as its publisher asked, counted from the replay. A value the broker would
    refuse as an expiration (not a count) stays a header."""
    headers = replay_headers(source.headers, handle_again=handle_again)
    headers.update(extra or {})
    changes: dict[str, Any] = {}
    ttl = as_text(headers.get(ORIGINAL_EXPIRATION))
    if not source.expiration and ttl is not None and as_count(ttl) is not None:
        changes["expiration"] = str(as_count(ttl))
        del headers[ORIGINAL_EXPIRATION]
    if handle_again:
        # The broker checks a user_id against the publishing connection: what makes a worker
        # believe ``handle-again`` from a replayer and from no publisher.
        changes["user_id"] = user
    return republish_properties(source, headers, user, **changes)
