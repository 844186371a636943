"""Pause and Idempotency against the real broker (and the real stores), every message counted."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.amqp import (
    all_empty,
    consuming,
    counts,
    depth,
    drain,
    persistent,
    publish,
    publish_stream,
)
from support.poll import eventually
from support.provision import provision, topology
from support.stores import POSTGRES_URL, REDIS_URL
from support.worker import running, scraped

from rabbit_retry import metric_names
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Idempotency, Pause, Permanent, RetryConsumer

Q = "payments.charge"
OTHER = "payments.audit"
OUTAGE_SECONDS = 20.0


def charge_yaml(queue_type: str = "quorum") -> str:
    # The new user: one short delay, three attempts. Without a pause, an outage parks
    # every message within seconds.
    return f"""\
version: 1
exchanges:
  payments: {{type: direct}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: payments, routing_key: charge}}]
    retry: {{delays: [1s], max_attempts: 3}}
  {OTHER}:
    queue_type: classic
    bindings: [{{exchange: payments, routing_key: audit}}]
    retry: {{delays: [1s], max_attempts: 3}}
"""


class GatewayDown(ConnectionError):
    pass


class Gateway:
    """The downstream: up or down, and every charge it made (the side effects)."""

    def __init__(self) -> None:
        self.up = True
        self.charged: list[str] = []
        self.calls = 0

    def charge(self, delivery: Delivery) -> None:
        self.calls += 1
        if not self.up:
            raise GatewayDown("payment gateway unreachable")
        assert delivery.message_id is not None
        self.charged.append(delivery.message_id)


class Charge(RetryConsumer):
    queue = Q
    prefetch = 10
    handler_timeout = 10.0

    def __init__(self, gateway: Gateway, *, pause: Pause | None = None) -> None:
        self.gateway = gateway
        self.pause = pause
        self.attempts: dict[str, int] = {}
        self.sources: set[tuple[str, str]] = set()

    async def handle(self, delivery: Delivery) -> None:
        await asyncio.sleep(0.005)  # a little I/O, so deliveries overlap
        assert delivery.message_id is not None
        self.attempts[delivery.message_id] = delivery.attempt
        self.sources.add((delivery.exchange, delivery.routing_key))
        self.gateway.charge(delivery)


class Audit(RetryConsumer):
    queue = OTHER
    prefetch = 5

    def __init__(self) -> None:
        self.seen = 0

    async def handle(self, delivery: Delivery) -> None:
        self.seen += 1


def value(runner: Any, name: str, *labels: str) -> float:
    series = {"messages": metric_names.MESSAGES, "paused": metric_names.PAUSED,
              "pauses": metric_names.PAUSES, "duplicates": metric_names.DUPLICATES}[name]
    return scraped(runner, series, *labels)


async def outage(settings: Settings, consumer: Charge, gateway: Gateway, seconds: float,
                 count: int, audit: Audit | None = None, queue_type: str = "quorum") -> Any:
    """Publish ``count`` charges while the gateway is down for ``seconds``; then bring it back
    and wait until the queue and its tier are empty. Returns the runner's final metrics."""
    topo = topology(charge_yaml(queue_type))
    await provision(settings, topo)
    consumers: list[RetryConsumer] = [consumer] + ([audit] if audit is not None else [])
    async with running(consumers, topo, settings) as runner:
        gateway.up = False
        await publish(settings, b"{}", exchange="payments", routing_key="charge", count=count)
        if audit is not None:
            await eventually(lambda: value(runner, "paused", Q) == 1, within=30, what="paused")
            before = audit.seen
            await publish(settings, b"{}", exchange="payments", routing_key="audit", count=20)
            # The other consumer keeps going while the first is paused.
            await eventually(lambda: audit.seen >= before + 20, within=30, what="audit consumed")
            assert value(runner, "paused", Q) == 1
        await asyncio.sleep(seconds)
        gateway.up = True
        await eventually(lambda: len(set(gateway.charged)) + int(
            value(runner, "messages", Q, "parked")) >= count, within=120, what="all settled")
        await eventually(lambda: all_empty(settings, Q, f"{Q}.retry.1s"), within=30, what="drained")
        return runner


async def publish_ids(settings: Settings, ids: list[str], routing_key: str = "charge") -> None:
    """One persistent, confirmed message per id, in order, on one connection."""
    await publish_stream(settings, routing_key, len(ids),
                         lambda i: persistent(b"{}", message_id=ids[i]), exchange="payments",
                         window=1)


async def test_an_outage_parks_everything_without_a_pause(fresh_vhost: Settings) -> None:
    """The positive control of the next test: the same outage, no pause, messages park."""
    gateway = Gateway()
    runner = await outage(fresh_vhost, Charge(gateway), gateway, 4.0, 50)
    parked = value(runner, "messages", Q, "parked")
    print(f"[resilience] no pause: 50 messages, 4s outage: parked {parked:g}")
    assert parked > 0
    assert await depth(fresh_vhost, f"{Q}.parking") == parked
    assert len(gateway.charged) + parked == 50


@pytest.mark.parametrize(("queue_type", "seconds"), [("quorum", OUTAGE_SECONDS), ("classic", 6.0)])
async def test_a_paused_queue_rides_out_an_outage_and_parks_nothing(
    fresh_vhost: Settings, caplog: pytest.LogCaptureFixture, queue_type: str, seconds: float
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_retry.worker")
    gateway = Gateway()
    rule = Pause(after=3, on=(GatewayDown,), probe_every=1.0)
    consumer = Charge(gateway, pause=rule)
    audit = Audit()
    runner = await outage(fresh_vhost, consumer, gateway, seconds, 200, audit, queue_type)

    print(f"[resilience] {queue_type}: 200 messages, {seconds:g}s outage: parked "
          f"{value(runner, 'messages', Q, 'parked'):g}, charged attempts "
          f"{value(runner, 'messages', Q, 'retried'):g}, gateway calls {gateway.calls}, "
          f"pauses {value(runner, 'pauses', Q):g}")
    assert await depth(fresh_vhost, f"{Q}.parking") == 0
    assert value(runner, "messages", Q, "parked") == 0
    # Every message succeeded, once.
    assert sorted(gateway.charged) == sorted(f"m-{i}" for i in range(200))
    # Only the failures that tripped the pause were charged to their messages: every other
    # message succeeded at its first attempt, whatever the broker version counts on a return.
    charged_attempts = sum(a - 1 for a in consumer.attempts.values())
    assert charged_attempts == value(runner, "messages", Q, "retried") <= rule.after
    assert value(runner, "pauses", Q) >= 1
    assert value(runner, "paused", Q) == 0
    # Sent back to the queue, a message still shows where it was first published.
    assert consumer.sources == {("payments", "charge")}
    # The gateway saw far fewer calls than an unpaused outage would make: the trip, the
    # deliveries in flight at that moment, one probe a second, then the 200 successes.
    assert gateway.calls < 200 + consumer.prefetch + rule.after + 2 * seconds + 20
    paused_lines = [r for r in caplog.records if getattr(r, "event", "") == "paused"]
    resumed_lines = [r for r in caplog.records if getattr(r, "event", "") == "resumed"]
    assert len(paused_lines) == value(runner, "pauses", Q) == len(resumed_lines)
    assert "GatewayDown" in paused_lines[0].getMessage()


async def test_a_poison_message_alone_does_not_pause_the_queue(fresh_vhost: Settings) -> None:
    """One message failing on every attempt is not an outage: it parks, the queue runs on."""
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    gateway = Gateway()

    class Poisoned(Charge):
        async def handle(self, delivery: Delivery) -> None:
            if delivery.message_id == "m-0":
                raise GatewayDown("only this one")
            await super().handle(delivery)

    consumer = Poisoned(gateway, pause=Pause(after=2, on=(GatewayDown,), probe_every=60))
    async with running([consumer], topo, fresh_vhost) as runner:
        await publish_ids(fresh_vhost, ["m-0"])
        await eventually(lambda: value(runner, "messages", Q, "parked") == 1, within=60,
                         what="the poison message parked")
        await publish_ids(fresh_vhost, [f"ok-{i}" for i in range(10)])
        await eventually(lambda: len(gateway.charged) == 10, within=30, what="10 charges")
        # It failed three times in a row, more than ``after``, yet paused nothing.
        assert value(runner, "messages", Q, "retried") == 2
        assert value(runner, "pauses", Q) == 0


async def _paused(settings: Settings, runner: Any, gateway: Gateway, count: int) -> None:
    """The gateway down and ``count`` charges published: the runner's queue pauses."""
    gateway.up = False
    await publish_ids(settings, [f"m-{i}" for i in range(count)])
    await eventually(lambda: value(runner, "paused", Q) == 1, within=30, what="paused")


async def held(settings: Settings, count: int) -> bool:
    return await depth(settings, Q) == count and await all_empty(settings, Q + ".retry.1s")


async def test_a_paused_worker_resumes_when_another_consumer_drains_the_queue(
    fresh_vhost: Settings,
) -> None:
    """Another replica resumed and drains the queue: this one's probes find nothing to ask the
    downstream with, and it must not stay paused for ever (its alert firing on a healthy
    queue). An empty queue nobody consumes says nothing, and the pause holds."""
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    gateway = Gateway()
    consumer = Charge(gateway, pause=Pause(after=3, on=(GatewayDown,), probe_every=0.3))
    async with running([consumer], topo, fresh_vhost) as runner:
        await _paused(fresh_vhost, runner, gateway, 3)
        await eventually(lambda: held(fresh_vhost, 3), within=30,
                         what="the tripping failures back and held in the queue")
        await drain(fresh_vhost, Q, consumer=False)
        await asyncio.sleep(1.5)  # five probes of an empty queue nobody consumes
        assert value(runner, "paused", Q) == 1
        async with consuming(fresh_vhost, Q):  # another replica, resumed
            await eventually(lambda: value(runner, "paused", Q) == 0, within=10,
                             what="resumed at the next probe")
        gateway.up = True
        await publish_ids(fresh_vhost, ["after"])
        await eventually(lambda: "after" in gateway.charged, within=10, what="consuming again")


async def test_a_probe_failing_for_another_reason_resumes_the_queue(
    fresh_vhost: Settings,
) -> None:
    """A probe whose message fails for a reason the pause does not watch (here ``Permanent``):
    the downstream answered, the queue resumes; the message parks as it would anyway."""
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    gateway = Gateway()

    class Declining(Charge):
        async def handle(self, delivery: Delivery) -> None:
            if delivery.message_id == "declined":
                raise Permanent("card declined")
            await super().handle(delivery)

    consumer = Declining(gateway, pause=Pause(after=3, on=(GatewayDown,), probe_every=0.5))
    async with running([consumer], topo, fresh_vhost) as runner:
        await _paused(fresh_vhost, runner, gateway, 3)
        await eventually(lambda: held(fresh_vhost, 3), within=30,
                         what="the tripping failures back and held in the queue")
        await drain(fresh_vhost, Q, consumer=False)
        await publish_ids(fresh_vhost, ["declined"])
        await eventually(lambda: value(runner, "messages", Q, "parked") == 1, within=10,
                         what="the probe's message parked")
        await eventually(lambda: value(runner, "paused", Q) == 0, within=5, what="resumed")


async def test_two_paused_workers_both_resume_after_an_outage(fresh_vhost: Settings) -> None:
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    gateway = Gateway()
    pause = Pause(after=3, on=(GatewayDown,), probe_every=0.5)
    one, two = Charge(gateway, pause=pause), Charge(gateway, pause=pause)
    async with running([one], topo, fresh_vhost) as a, running([two], topo, fresh_vhost) as b:
        gateway.up = False
        await publish_ids(fresh_vhost, [f"m-{i}" for i in range(40)])
        await eventually(lambda: value(a, "paused", Q) == 1 and value(b, "paused", Q) == 1,
                         within=30, what="both paused")
        gateway.up = True
        await eventually(lambda: len(set(gateway.charged)) == 40, within=60, what="40 charges")
        await eventually(lambda: value(a, "paused", Q) == 0 and value(b, "paused", Q) == 0,
                         within=10, what="both resumed")
        assert value(a, "messages", Q, "parked") + value(b, "messages", Q, "parked") == 0


# --- idempotency -------------------------------------------------------------------------------


def store_urls(tmp_path: Path) -> Iterator[tuple[str, str]]:
    yield "sqlite", f"sqlite:///{tmp_path / 'dedupe.db'}"
    yield "postgresql", POSTGRES_URL
    yield "redis", REDIS_URL


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return dict(store_urls(tmp_path))[request.param]


class Effects(RetryConsumer):
    """Counts side effects per key; notes overlapping runs of one key."""

    queue = Q
    prefetch = 20
    handler_timeout = 10.0

    def __init__(self, idempotency: Idempotency, effects: Counter[str], running: set[str],
                 overlaps: list[str], fail_first: Callable[[Delivery], bool] = lambda d: False
                 ) -> None:
        self.idempotency = idempotency
        self.effects = effects
        self.running_keys = running
        self.overlaps = overlaps
        self.fail_first = fail_first

    async def handle(self, delivery: Delivery) -> None:
        key = delivery.message_id
        assert key is not None
        if key in self.running_keys:
            self.overlaps.append(key)
        self.running_keys.add(key)
        try:
            await asyncio.sleep(0.01)
            if delivery.attempt == 1 and self.fail_first(delivery):
                raise RuntimeError("fails once")
            self.effects[key] += 1
        finally:
            self.running_keys.discard(key)


async def test_duplicates_run_the_handler_once_across_two_workers(
    fresh_vhost: Settings, store_url: str
) -> None:
    """1,000 messages, 300 of them a second copy of another: exactly 700 side effects, even
    with two workers on the queue and the copies delivered side by side."""
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    rule = Idempotency(store_url, window=3600)
    effects: Counter[str] = Counter()
    running_keys: set[str] = set()
    overlaps: list[str] = []
    # A distinct key space per run: the PostgreSQL and Redis stores outlive the test.
    run = uuid.uuid4().hex[:8]
    ids = [f"{run}-{i}" for i in range(700)]
    # The copy right behind its original: the two land in different workers at the same time.
    sequence = [k for i, k in enumerate(ids) for k in ([k, k] if i < 300 else [k])]
    assert len(sequence) == 1000
    one = Effects(rule, effects, running_keys, overlaps, fail_first=lambda d: d.message_id in
                  {ids[1], ids[2]})
    two = Effects(rule, effects, running_keys, overlaps, fail_first=lambda d: d.message_id in
                  {ids[1], ids[2]})
    async with running([one], topo, fresh_vhost) as first, running([two], topo, fresh_vhost) as \
            second:
        await publish_ids(fresh_vhost, sequence)
        dupes = lambda: sum(value(r, "duplicates", Q) for r in (first, second))  # noqa: E731
        await eventually(lambda: len(effects) == 700 and dupes() == 300, within=120,
                         what="700 effects and 300 duplicates")
        await eventually(lambda: all_empty(fresh_vhost, Q, f"{Q}.retry.1s"), within=30,
                         what="drained")
    assert sum(effects.values()) == 700
    assert set(effects) == set(ids)
    assert overlaps == []
    # The two that failed once released their keys and were handled on their retry.
    assert effects[ids[1]] == effects[ids[2]] == 1
    assert await depth(fresh_vhost, f"{Q}.parking") == 0


async def test_a_pause_outlives_a_reconnect_and_resumes_at_a_probe(
    fresh_vhost: Settings, management: Management, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_retry.worker")
    topo = topology(charge_yaml())
    await provision(fresh_vhost, topo)
    gateway = Gateway()
    consumer = Charge(gateway, pause=Pause(after=2, on=(GatewayDown,), probe_every=0.5))
    async with running([consumer], topo, fresh_vhost) as runner:
        gateway.up = False
        await publish_ids(fresh_vhost, [f"m-{i}" for i in range(20)])
        await eventually(lambda: value(runner, "paused", Q) == 1, within=30, what="paused")
        # The broker closes the worker's connection: it reconnects by itself, still paused.
        names = await eventually(lambda: [c["name"] for c in management.connections(
            fresh_vhost.vhost) if (c.get("client_properties") or {}).get("connection_name")
            == "rabbit-retry worker"], within=30, what="the worker's connection")
        for name in names:
            management.close_connection(name, reason="test: reconnect while paused")
        await eventually(lambda: any(getattr(r, "event", "") == "reconnected"
                                     for r in caplog.records), within=60, what="reconnected")
        await eventually(lambda: runner.ready.is_set(), within=60, what="ready again")
        assert value(runner, "paused", Q) == 1
        assert (await counts(fresh_vhost, Q))[1] == 0  # no consumer on the queue
        calls = gateway.calls
        # Probes still run (and fail) while the gateway is down...
        await eventually(lambda: gateway.calls > calls, within=30, what="a probe")
        assert value(runner, "paused", Q) == 1
        gateway.up = True
        # ...and the first one after it is back resumes the queue.
        await eventually(lambda: value(runner, "paused", Q) == 0, within=30, what="resumed")
        await eventually(lambda: len(set(gateway.charged)) == 20, within=60, what="20 charges")
        assert (await counts(fresh_vhost, Q))[1] == 1
    assert value(runner, "messages", Q, "parked") == 0
