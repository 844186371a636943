"""Parked messages for the parking and status tests (test-only): messages shaped like the
worker's parked ones, and an oracle that reads a queue independently of the code under test (the
management API's "get messages", which requeues what it reads)."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from pamqp import commands as spec

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

from .amqp import publish_raw


@dataclass
class Parked:
    """A message as the worker parks it; ``headers`` are added to (or override) the parking ones."""

    body: bytes
    exception_type: str = "ValueError"
    reason: str = "exhausted"
    parked_at: str | None = None
    retry_count: int = 3
    message_id: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    properties: Mapping[str, Any] = field(default_factory=dict)

    def amqp_headers(self, queue: str) -> dict[str, Any]:
        moment = self.parked_at or dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        return {
            "parked-reason": self.reason,
            "parked-at": moment,
            "retry-count": self.retry_count,
            "exception-type": self.exception_type,
            "exception-message": f"{self.exception_type} on {self.body[:20]!r}",
            "exception-stacktrace": "Traceback (most recent call last):\n  ...\n",
            "original-exchange": "orders",
            "original-routing-key": "order.created",
            "original-queue": queue,
            "x-death": [
                {"count": self.retry_count, "reason": "rejected", "queue": queue,
                 "exchange": "orders", "routing-keys": ["order.created"],
                 "time": dt.datetime(2024, 1, 1, tzinfo=dt.UTC)},
            ],
            "x-first-death-reason": "rejected",
            "x-first-death-queue": queue,
            "x-first-death-exchange": "orders",
            **self.headers,
        }


async def park(settings: Settings, queue: str, messages: Sequence[Parked]) -> None:
    """Publishes ``messages`` to ``queue``.parking, in order, each confirmed by the broker."""
    await publish_raw(
        settings,
        [
            (m.body, spec.Basic.Properties(headers=m.amqp_headers(queue), delivery_mode=2,
                                           message_id=m.message_id, **m.properties))
            for m in messages
        ],
        routing_key=f"{queue}.parking",
    )


@dataclass(frozen=True)
class Seen:
    """A message as the management API shows it."""

    body: bytes
    headers: dict[str, Any]
    properties: dict[str, Any]
    redelivered: bool


def look(api: Management, settings: Settings, queue: str, count: int = 10_000) -> list[Seen]:
    """Every message in ``queue`` in order, requeued as the management UI's "get" does."""
    path = f"/queues/{quote(settings.vhost, safe='')}/{quote(queue, safe='')}/get"
    response = api.request(
        "POST", path, json={"count": count, "ackmode": "ack_requeue_true", "encoding": "base64"}
    )
    response.raise_for_status()
    out = []
    for item in response.json():
        properties = dict(item.get("properties") or {})
        headers = dict(properties.pop("headers", {}) or {})
        out.append(Seen(base64.b64decode(item["payload"]), headers, properties,
                        bool(item.get("redelivered"))))
    return out
