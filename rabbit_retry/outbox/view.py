"""An outbox event as an operator sees it (the failure desk's JSON): pure.

Dead events are shown beside parked messages, in the same shape where the two share a meaning:
``id``, ``message_id``, ``status``, ``attempts``, ``headers`` (JSON view), ``properties``,
``body`` as text when it is UTF-8 (else ``body_base64``), and a ``history``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from rabbit_retry.outbox.destinations import destination_name
from rabbit_retry.parking.message import jsonable
from rabbit_retry.wire import decode_table


def shown(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row of ``OutboxStore.events`` or ``OutboxStore.event`` as JSON."""
    body = bytes(row["body"])
    out: dict[str, Any] = {
        "id": row["id"],
        "kind": "outbox",
        "destination": destination_name(row["exchange"], row["routing_key"]),
        "exchange": row["exchange"],
        "routing_key": row["routing_key"],
        "message_id": row["message_id"],
        "key": row["order_key"],
        "status": row["status"],
        "attempts": row["attempts"],
        "error": row["last_error"],
        "created_at": _when(row["created_at"]),
        "changed_at": _when(row.get("changed_at")),
        "due_at": _when(row.get("due_at")),
        "published_at": _when(row.get("published_at")),
        "headers": jsonable(decode_table(bytes(row["headers"]))) if row["headers"] else {},
        "properties": json.loads(row["properties"]) if row["properties"] else {},
        "trace": json.loads(row["trace"]) if row["trace"] else None,
    }
    try:
        out["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(body).decode("ascii")
    if "history" in row:
        out["history"] = [{**entry, "at": _when(entry["at"])} for entry in row["history"]]
    return out


def _when(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
