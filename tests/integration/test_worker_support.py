"""Helpers shared by the worker's integration tests (no tests here).

Objects are declared straight from ``compile_topology`` so these tests depend only on the
compiler, not on the provisioner's command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage

from rabbit_retry.contract import copy_properties
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology, compile_topology, parse_topology
from rabbit_retry.worker import RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics


def topology(text: str, source: str = "worker-test.yml") -> Topology:
    return parse_topology(text, source)


async def provision(settings: Settings, topo: Topology) -> None:
    plan = compile_topology(topo)
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        for ex in plan.exchanges:
            await channel.declare_exchange(
                ex.name,
                ex.type,
                durable=ex.durable,
                auto_delete=ex.auto_delete,
                internal=ex.internal,
                arguments=dict(ex.arguments),
            )
        for q in plan.queues:
            await channel.declare_queue(q.name, durable=True, arguments=dict(q.arguments))
        for b in plan.bindings:
            queue = await channel.get_queue(b.destination, ensure=False)
            await queue.bind(b.source, b.routing_key, arguments=dict(b.arguments))


async def publish(
    settings: Settings,
    body: bytes,
    *,
    exchange: str = "",
    routing_key: str,
    count: int = 1,
    **properties: Any,
) -> None:
    """Publish ``count`` persistent copies with publisher confirms."""
    properties.setdefault("delivery_mode", aio_pika.DeliveryMode.PERSISTENT)
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = (
            channel.default_exchange
            if exchange == ""
            else await channel.get_exchange(exchange, ensure=False)
        )
        for i in range(count):
            props = dict(properties)
            if count > 1 and "message_id" not in props:
                props["message_id"] = f"m-{i}"
            await target.publish(aio_pika.Message(body, **props), routing_key=routing_key)


async def raw_publish(
    settings: Settings,
    body: bytes,
    *,
    exchange: str = "",
    routing_key: str,
    properties: aiormq.spec.Basic.Properties,
) -> None:
    """Publish with exactly these wire properties (aio-pika's Message would normalise them).

    Headers go through the worker's own table encoder: pamqp cannot send a non-UTF-8 string.
    """
    properties = copy_properties(properties, properties.headers or {})
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=properties,
            mandatory=True,
        )
    finally:
        await connection.close()


async def depth(settings: Settings, queue: str) -> int:
    """Ready messages in ``queue`` (a passive declare: exact, no management API lag)."""
    connection = await aiormq.connect(settings.url)
    try:
        channel = await connection.channel()
        ok = await channel.queue_declare(queue, passive=True)
        return int(ok.message_count or 0)
    finally:
        await connection.close()


async def drain(settings: Settings, queue: str) -> list[aiormq.abc.DeliveredMessage]:
    """Take (and ack) every ready message of ``queue``, raw, in order."""
    connection = await aiormq.connect(settings.url)
    taken = []
    try:
        channel = await connection.channel()
        while True:
            message = await channel.basic_get(queue)
            if not isinstance(message.delivery, aiormq.spec.Basic.GetOk):
                break
            taken.append(message)
            await channel.basic_ack(message.delivery.delivery_tag)
    finally:
        await connection.close()
    return taken


async def get_one(settings: Settings, queue: str) -> AbstractIncomingMessage | None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        q = await channel.get_queue(queue, ensure=False)
        message = await q.get(fail=False)
        if message is not None:
            await message.ack()
        return message


async def eventually(
    check: Callable[[], Any], *, within: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy; fail after ``within``
    seconds (a generous deadline for something to happen, never a timing assertion)."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within}s waiting for {what or check}: last={last!r}")


@contextlib.asynccontextmanager
async def running(
    consumers: Sequence[RetryConsumer],
    topo: Topology,
    settings: Settings,
    *,
    grace: float = 5.0,
    metrics_port: int | None = None,
) -> AsyncIterator[Runner]:
    """Run a worker in this event loop for the duration of the block."""
    runner = Runner(
        consumers,
        topology=topo,
        settings=settings,
        grace=grace,
        metrics=Metrics(),
        metrics_port=metrics_port,
    )
    task = asyncio.create_task(runner.run())
    try:
        await eventually(
            lambda: runner.ready.is_set() or task.done(), within=30, what="worker ready"
        )
        if task.done():
            task.result()  # raises the startup error
        yield runner
    finally:
        runner.stop()
        await asyncio.wait_for(task, timeout=60)
