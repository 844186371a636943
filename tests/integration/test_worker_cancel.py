"""A consumer cancelled while it may have credit (entering probation, a pause) strands nothing:
every message is handled and the queue ends with nothing unacknowledged while the worker keeps
running, on every version (docs/versions.md, "A consumer is cancelled ...")."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import aiormq
import pytest
from support.amqp import publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running, scraped

from rabbit_retry import metric_names
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Pause, RetryConsumer

Q = "cancel.orders"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    retry: {{delays: [200ms], max_attempts: 3}}
"""
ROUNDS = 12


class Busy(RetryConsumer):
    queue = Q
    prefetch = 20

    def __init__(self) -> None:
        self.handled: Counter[str] = Counter()

    async def handle(self, delivery: Delivery) -> None:
        await asyncio.sleep(0.01)
        self.handled[delivery.message_id or ""] += 1


class Dying:
    """Another consumer of the queue that takes a few messages and dies with them: they come
    back counted (quorum), so the worker, busy at full prefetch, meets returned deliveries and
    enters probation, cancelling its consumer while it has credit."""

    def __init__(self, settings: Settings, count: int) -> None:
        self.settings, self.count = settings, count
        self.taken: list[object] = []

    async def __aenter__(self) -> Dying:
        self.connection = await aiormq.connect(self.settings.url)
        channel = await self.connection.channel()
        await channel.basic_qos(prefetch_count=self.count)

        async def take(message: aiormq.abc.DeliveredMessage) -> None:
            self.taken.append(message)

        await channel.basic_consume(Q, take)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.connection.close()  # unacked: back to the queue, each return counted


async def _unacked(management: Management, settings: Settings) -> int:
    info = management.queue(settings.vhost, Q) or {}
    return int(info.get("messages_unacknowledged", -1)) + int(info.get("messages_ready", -1))


async def test_entering_probation_while_busy_strands_no_delivery(
    fresh_vhost: Settings, management: Management, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_retry.worker")
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    consumer = Busy()
    expected: set[str] = set()
    async with running([consumer], topo, fresh_vhost) as runner:
        returned = 0
        for n in range(ROUNDS):
            ids = [f"r{n}-{i}" for i in range(60)]
            expected |= set(ids)
            async with Dying(fresh_vhost, 3) as dying:
                for message_id in ids:
                    await publish(fresh_vhost, b"{}", routing_key=Q, message_id=message_id)
                await eventually(lambda d=dying: len(d.taken) == 3, within=10,  # type: ignore[misc]
                                 what="the other consumer holding 3")
            returned += len(dying.taken)
        await eventually(lambda: set(consumer.handled) == expected, within=120,
                         what="every message handled")
        assert returned == 3 * ROUNDS
        # The positive control: the busy worker did meet returned deliveries and cancelled its
        # full-prefetch consumer to take them alone.
        entered = [r for r in caplog.records if "handling returned messages one at a time"
                   in r.getMessage()]
        assert len(entered) >= ROUNDS // 2, len(entered)
        # Nothing left unacknowledged on the broker while the worker still runs (3.10 kept
        # stranded deliveries unacked until the worker reconnected).
        await eventually(lambda: _settled(management, fresh_vhost), within=30,
                         what="nothing unacknowledged or ready")
        assert scraped(runner, metric_names.PARKED, Q, "exhausted") == 0


async def _settled(management: Management, settings: Settings) -> bool:
    await asyncio.sleep(0)
    return await _unacked(management, settings) == 0


class GatewayDown(ConnectionError):
    pass


class Pausing(Busy):
    pause = Pause(after=3, on=(GatewayDown,), probe_every=0.5)

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def handle(self, delivery: Delivery) -> None:
        if self.down:
            raise GatewayDown("down")
        await super().handle(delivery)


async def test_a_pause_strands_no_delivery(
    fresh_vhost: Settings, management: Management
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    consumer = Pausing()
    ids = [f"p-{i}" for i in range(200)]
    async with running([consumer], topo, fresh_vhost) as runner:
        for message_id in ids:
            await publish(fresh_vhost, b"{}", routing_key=Q, message_id=message_id)
        await eventually(lambda: scraped(runner, metric_names.PAUSED, Q) == 1, what="paused")
        consumer.down = False
        await eventually(lambda: set(consumer.handled) == set(ids), within=120,
                         what="every message handled after the outage")
        await eventually(lambda: _settled(management, fresh_vhost), within=30,
                         what="nothing unacknowledged or ready")
