"""Every shape a handler can take runs before its message is settled: plain and async, decorated
both ways, and handlers that hand back a coroutine instead of running it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest
from support.amqp import all_empty, depth, drain, publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running, scraped

from rabbit_retry import metric_names
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Permanent, RetryConsumer

Q = "shapes.q"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    retry: {{delays: [200ms], max_attempts: 2}}
"""


def timed(handle: Callable[..., Any]) -> Callable[..., Any]:
    """A timing decorator as teams write them: a plain wrapper, whatever it wraps."""

    @functools.wraps(handle)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return handle(*args, **kwargs)

    return wrapper


def timed_async(handle: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handle)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await handle(*args, **kwargs)

    return wrapper


def consumer_of(shape: str, ran: list[str], fail: bool) -> RetryConsumer:
    def work(delivery: Delivery) -> None:
        ran.append(delivery.message_id or "")
        if fail:
            raise Permanent("declined")

    async def awork(delivery: Delivery) -> None:
        await asyncio.sleep(0)
        work(delivery)

    class Base(RetryConsumer):
        queue = Q

    if shape == "async def":
        class Shape(Base):
            async def handle(self, delivery: Delivery) -> None:
                await awork(delivery)
    elif shape == "def":
        class Shape(Base):  # type: ignore[no-redef]
            def handle(self, delivery: Delivery) -> None:
                work(delivery)
    elif shape == "plain decorator on async def":
        class Shape(Base):  # type: ignore[no-redef]
            @timed
            async def handle(self, delivery: Delivery) -> None:
                await awork(delivery)
    elif shape == "async decorator on async def":
        class Shape(Base):  # type: ignore[no-redef]
            @timed_async
            async def handle(self, delivery: Delivery) -> None:
                await awork(delivery)
    elif shape == "plain decorator on def":
        class Shape(Base):  # type: ignore[no-redef]
            @timed
            def handle(self, delivery: Delivery) -> None:
                work(delivery)
    elif shape == "def returning a coroutine":
        class Shape(Base):  # type: ignore[no-redef]
            def handle(self, delivery: Delivery) -> Any:
                return awork(delivery)
    elif shape == "async def returning a coroutine":
        class Shape(Base):  # type: ignore[no-redef]
            async def handle(self, delivery: Delivery) -> Any:
                return awork(delivery)
    else:
        raise AssertionError(shape)
    return Shape()


SHAPES = [
    "async def",
    "def",
    "plain decorator on async def",
    "async decorator on async def",
    "plain decorator on def",
    "def returning a coroutine",
    "async def returning a coroutine",
]


@pytest.mark.parametrize("shape", SHAPES)
async def test_every_handler_shape_runs_before_its_message_is_settled(
    fresh_vhost: Settings, shape: str
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    ran: list[str] = []
    failing = consumer_of(shape, ran, fail=True)
    async with running([failing], topo, fresh_vhost) as runner:
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="fails")
        await eventually(lambda: scraped(runner, metric_names.PARKED, Q, "permanent") == 1,
                         what="the failing message parked")
        await eventually(lambda: all_empty(fresh_vhost, Q), what="the original acked")
        assert scraped(runner, metric_names.MESSAGES, Q, "success") == 0
    assert ran == ["fails"]
    [parked] = await drain(fresh_vhost, Q + ".parking")
    assert parked.headers["exception-type"] == "rabbit_retry.worker.consumer.Permanent"

    ran.clear()
    succeeding = consumer_of(shape, ran, fail=False)
    async with running([succeeding], topo, fresh_vhost) as runner:
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="works")
        await eventually(lambda: scraped(runner, metric_names.MESSAGES, Q, "success") == 1,
                         what="the message handled")
        await eventually(lambda: all_empty(fresh_vhost, Q), what="acked")
    assert ran == ["works"]
    assert await depth(fresh_vhost, Q + ".parking") == 0
