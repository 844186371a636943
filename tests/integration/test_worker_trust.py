"""The trust boundary, on a real broker: the headers rabbit-retry acts on are believed only where
it can know it wrote them (README, "What a publisher can and cannot influence"), and attempts
charged by another consumer of the queue are named in the parked record."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import aiormq
from support.amqp import all_empty, depth, drain, publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running, scraped

from rabbit_retry import metric_names
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Idempotency, Permanent, RetryConsumer

Q = "trust.orders"
PARKING = Q + ".parking"
TOPOLOGY = f"""\
version: 1
exchanges:
  orders: {{type: topic}}
queues:
  {Q}:
    bindings: [{{exchange: orders, routing_key: order.created}}]
    retry: {{delays: [300ms, 600ms], max_attempts: 4}}
"""
FORGED = {
    "original-exchange": "evil",
    "original-routing-key": "evil.rk",
    "retry-count": 2,
    "x-death": [{"queue": Q, "reason": "rejected", "count": 3, "exchange": "evil",
                 "routing-keys": ["evil.rk"],
                 "time": datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)}],
}


class Seen(RetryConsumer):
    queue = Q
    prefetch = 5

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[Delivery] = []

    async def handle(self, delivery: Delivery) -> None:
        self.seen.append(delivery)
        if self.fail:
            raise Permanent("declined")


async def test_a_publishers_copy_of_our_headers_changes_nothing(fresh_vhost: Settings) -> None:
    """Published through an exchange with forged ``original-*``, ``retry-count`` and
    ``x-death``: the handler sees where it really came from and its real attempt (1), and
    the parked copy records the real source."""
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    consumer = Seen(fail=True)
    async with running([consumer], topo, fresh_vhost) as runner:
        await publish(fresh_vhost, b"{}", exchange="orders", routing_key="order.created",
                      message_id="forged", headers=FORGED)
        await eventually(lambda: scraped(runner, metric_names.PARKED, Q, "permanent") == 1,
                         what="parked")
    [delivery] = consumer.seen
    assert (delivery.exchange, delivery.routing_key) == ("orders", "order.created")
    assert delivery.attempt == 1
    [parked] = await drain(fresh_vhost, PARKING)
    assert parked.headers["original-exchange"] == "orders"
    assert parked.headers["original-routing-key"] == "order.created"
    assert parked.headers["retry-count"] == 1
    assert "failures-elsewhere" not in parked.headers


async def test_the_same_headers_on_a_copy_of_ours_are_believed(fresh_vhost: Settings) -> None:
    """The positive control: a copy arriving the way every copy of ours does (straight into
    the queue through the default exchange) keeps its source and its count."""
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    consumer = Seen()
    async with running([consumer], topo, fresh_vhost):
        headers = {k: v for k, v in FORGED.items() if k != "x-death"}
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="ours", headers=headers)
        await eventually(lambda: len(consumer.seen) == 1, what="handled")
    [delivery] = consumer.seen
    assert (delivery.exchange, delivery.routing_key, delivery.attempt) == ("evil", "evil.rk", 3)


async def test_handle_again_is_believed_from_a_replayer_only(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    consumer = Seen()
    consumer.idempotency = Idempotency(f"sqlite:///{tmp_path / 'keys.db'}")
    async with running([consumer], topo, fresh_vhost) as runner:
        await publish(fresh_vhost, b"{}", exchange="orders", routing_key="order.created",
                      message_id="once")
        await eventually(lambda: len(consumer.seen) == 1, what="handled once")
        # A publisher asking for it to run again: a duplicate like any other.
        await publish(fresh_vhost, b"{}", exchange="orders", routing_key="order.created",
                      message_id="once", headers={"handle-again": True})
        await eventually(lambda: scraped(runner, metric_names.DUPLICATES, Q) == 1,
                         what="the forged ask acked as a duplicate")
        # A replayer (here the worker's own user, as `parking replay --handle-again` publishes
        # it: the broker checks user_id against the connection).
        await publish(fresh_vhost, b"{}", routing_key=Q, message_id="once",
                      headers={"handle-again": True}, user_id=fresh_vhost.user)
        await eventually(lambda: len(consumer.seen) == 2, what="run again")
        assert scraped(runner, metric_names.DUPLICATES, Q) == 1


async def test_rejections_by_another_consumer_are_named_in_the_parked_record(
    fresh_vhost: Settings,
) -> None:
    """Another consumer of the queue rejects the message twice (the broker dead-letters it
    through the first tier each time, counting it in ``x-death``); the worker's handler then
    runs once and parks it: the record says two attempts were charged elsewhere."""
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    await publish(fresh_vhost, b"{}", exchange="orders", routing_key="order.created",
                  message_id="rejected")
    connection = await aiormq.connect(fresh_vhost.url)
    try:
        channel = await connection.channel()
        for _ in range(2):
            message = None
            for _ in range(200):
                message = await channel.basic_get(Q)
                if message.delivery_tag is not None:
                    break
                await asyncio.sleep(0.05)
            assert message is not None and message.delivery_tag is not None
            await channel.basic_nack(message.delivery_tag, requeue=False)
    finally:
        await connection.close()
    await eventually(lambda: depth_is(fresh_vhost, Q, 1), within=10, what="back in the queue")
    consumer = Seen(fail=True)
    async with running([consumer], topo, fresh_vhost) as runner:
        await eventually(lambda: scraped(runner, metric_names.PARKED, Q, "permanent") == 1,
                         what="parked")
    assert [d.attempt for d in consumer.seen] == [3]
    [parked] = await drain(fresh_vhost, PARKING)
    assert parked.headers["failures-elsewhere"] == 2
    assert parked.headers["retry-count"] == 3
    assert await all_empty(fresh_vhost, Q)


async def depth_is(settings: Settings, queue: str, count: int) -> bool:
    return await depth(settings, queue) == count
