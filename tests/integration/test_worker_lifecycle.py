"""A worker as operations run it: start and stop hooks, middleware around the handler, and the
probes a Kubernetes deployment asks (``/healthz``, ``/readyz``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from support.amqp import publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running, scraped

from rabbit_retry import metric_names
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Pause, Permanent, RetryConsumer, Runner
from rabbit_retry.worker.runner import StartError

Q = "ops.orders"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    retry: {{delays: [200ms], max_attempts: 2}}
"""


class Pooled(RetryConsumer):
    queue = Q

    def __init__(self, events: list[str], fail_start: bool = False) -> None:
        self.events = events
        self.fail_start = fail_start

    async def on_start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise ConnectionRefusedError("the database is down")

    async def on_stop(self) -> None:
        self.events.append("stop")

    async def handle(self, delivery: Delivery) -> None:
        self.events.append(f"handle {delivery.message_id}")
        if delivery.message_id == "bad":
            raise Permanent("declined")


async def test_on_start_runs_before_the_first_message_and_on_stop_after_the_last(
    fresh_vhost: Settings,
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    events: list[str] = []
    async with running([Pooled(events)], topo, fresh_vhost):
        assert events == ["start"]
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="m-1")
        await eventually(lambda: "handle m-1" in events, what="handled")
    assert events == ["start", "handle m-1", "stop"]


async def test_a_failing_on_start_stops_the_worker_before_it_consumes(
    fresh_vhost: Settings,
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    events: list[str] = []
    first = Pooled(events)
    second = Pooled(events, fail_start=True)
    second.queue = Q
    runner = Runner([first, second], topology=topo, settings=fresh_vhost)
    with pytest.raises(StartError) as failed:
        await runner.run()
    assert str(failed.value) == (
        "Pooled.on_start failed: ConnectionRefusedError: the database is down"
    )
    # The one that started is stopped again; nothing was consumed.
    assert events == ["start", "start", "stop"]
    assert StartError.exit_code == 1


async def test_middleware_runs_around_every_handler_call_in_order(fresh_vhost: Settings) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    events: list[str] = []

    def around(name: str) -> Callable[[Delivery, Callable[[Delivery], Awaitable[Any]]],
                                      Awaitable[None]]:
        async def middleware(delivery: Delivery,
                             call_next: Callable[[Delivery], Awaitable[Any]]) -> None:
            events.append(f"{name} in")
            try:
                await call_next(delivery)
            except Exception as exc:
                events.append(f"{name} saw {type(exc).__name__}")
                raise
            events.append(f"{name} out")

        return middleware

    consumer = Pooled(events)
    consumer.middleware = (around("outer"), around("inner"))
    async with running([consumer], topo, fresh_vhost) as runner:
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="ok")
        await eventually(lambda: "outer out" in events, what="handled")
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="bad")
        await eventually(lambda: scraped(runner, metric_names.PARKED, Q, "permanent") == 1,
                         what="the failure parked as usual")
    assert events == [
        "start",
        "outer in", "inner in", "handle ok", "inner out", "outer out",
        "outer in", "inner in", "handle bad", "inner saw Permanent", "outer saw Permanent",
        "stop",
    ]


class GatewayDown(ConnectionError):
    pass


class Failing(RetryConsumer):
    queue = Q
    pause = Pause(after=2, on=(GatewayDown,), probe_every=60)

    async def handle(self, delivery: Delivery) -> None:
        raise GatewayDown("down")


@pytest.mark.parametrize("ready_when_paused", [False, True])
async def test_probes_say_alive_and_ready_and_a_paused_queue_is_not_ready(
    fresh_vhost: Settings, ready_when_paused: bool
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    runner = Runner([Failing()], topology=topo, settings=fresh_vhost, metrics_port=0,
                    ready_when_paused=ready_when_paused)
    task = asyncio.create_task(runner.run())
    try:
        await eventually(lambda: runner.ready.is_set(), what="consuming")
        base = f"http://127.0.0.1:{runner.metrics_port}"
        async with httpx.AsyncClient(base_url=base) as http:
            assert ((await http.get("/healthz")).status_code, (await http.get("/healthz")).text) \
                == (200, "alive\n")
            ready = await http.get("/readyz")
            assert (ready.status_code, ready.text) == (200, "consuming\n")
            assert "rabbit_retry_in_flight" in (await http.get("/metrics")).text
            assert (await http.get("/")).status_code == 404
            await publish(fresh_vhost, b"{}", routing_key=Q, count=2)
            await eventually(lambda: scraped(runner, metric_names.PAUSED, Q) == 1,
                             what="paused")
            ready = await http.get("/readyz")
            if ready_when_paused:
                assert (ready.status_code, ready.text) == (200, "consuming\n")
            else:
                assert (ready.status_code, ready.text) == (
                    503, f"paused (its downstream fails): {Q}\n")
            assert (await http.get("/healthz")).status_code == 200
    finally:
        runner.stop()
        await asyncio.wait_for(task, 60)

