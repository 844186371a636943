"""Test helpers for the parking and status tests: provision a topology, park messages shaped
like the worker's, and read queues back through an oracle independent of the code under test
(the management API's "get messages", which requeues what it reads)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aio_pika
import aiormq
from pamqp import commands as spec

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Plan, compile_topology, parse_topology


async def provision(settings: Settings, yaml_text: str) -> Plan:
    """Declares every object the topology compiles to, as ``apply`` would on an empty vhost."""
    plan = compile_topology(parse_topology(yaml_text, "test.yml"))
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        raw = await channel.get_underlay_channel()
        for exchange in plan.exchanges:
            await raw.exchange_declare(
                exchange.name,
                exchange_type=exchange.type,
                durable=exchange.durable,
                auto_delete=exchange.auto_delete,
                internal=exchange.internal,
                arguments=dict(exchange.arguments),
            )
        for queue in plan.queues:
            await raw.queue_declare(queue.name, durable=queue.durable,
                                    arguments=dict(queue.arguments))
        for binding in plan.bindings:
            await raw.queue_bind(binding.destination, binding.source, binding.routing_key,
                                 arguments=dict(binding.arguments))
    return plan


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
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        raw = await channel.get_underlay_channel()
        for message in messages:
            properties = spec.Basic.Properties(
                headers=message.amqp_headers(queue),
                delivery_mode=2,
                message_id=message.message_id,
                **message.properties,
            )
            await raw.basic_publish(message.body, exchange="", routing_key=f"{queue}.parking",
                                    properties=properties, mandatory=True)


async def publish(settings: Settings, queue: str, bodies: Sequence[bytes]) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for body in bodies:
            await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue,
                                                   mandatory=True)


async def ready(settings: Settings, queue: str) -> int:
    """Messages ready in ``queue``, exact (a passive declare, not the lagging statistics)."""
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        raw = await channel.get_underlay_channel()
        ok = await raw.queue_declare(queue, passive=True)
        return int(ok.message_count or 0)


async def exists(settings: Settings, queue: str) -> bool:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        raw = await channel.get_underlay_channel()
        try:
            await raw.queue_declare(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True


@dataclass(frozen=True)
class Seen:
    """A message as the management API shows it."""

    body: bytes
    headers: dict[str, Any]
    properties: dict[str, Any]
    redelivered: bool


def look(api: Management, settings: Settings, queue: str, count: int = 10_000) -> list[Seen]:
    """Every message in ``queue`` in order, requeued as the management UI's "get" does."""
    import base64

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


async def take_all(settings: Settings, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Removes and returns every message of ``queue`` (for checking what a replay delivered)."""
    connection = await aio_pika.connect(settings.url)
    out = []
    async with connection:
        channel = await connection.channel()
        q = await channel.get_queue(queue, ensure=False)
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            out.append(message)
    return out
