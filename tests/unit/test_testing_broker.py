"""The in-memory broker of ``rabbit_retry.testing`` on its own: routing, dead-lettering with each
version's headers, TTLs on its virtual clock, confirms and returns, redelivery counts. Where a
real broker's behaviour was captured (tests/unit/fixtures), the fake is held to the capture."""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiormq.exceptions
import pytest
from aiormq import spec
from aiormq.abc import AbstractChannel, DeliveredMessage
from support.deliveries import capture_on

from rabbit_retry.broker.absence import is_missing
from rabbit_retry.contract import copy_properties
from rabbit_retry.testing import TestBroker, Unroutable
from rabbit_retry.testing.amqp import Channel, Connection

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = ("3.10", "4.0", "4.3")
START = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)

QUORUM = {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
          "x-overflow": "reject-publish"}


@pytest.fixture
async def empty() -> AsyncIterator[TestBroker]:
    async with TestBroker(None, start=START) as broker:
        yield broker


async def channel_of(broker: TestBroker, **options: Any) -> Channel:
    connection = await broker.connect()
    channel = await connection.channel(**options)
    assert isinstance(channel, Channel)
    return channel


async def taker(channel: AbstractChannel, queue: str, prefetch: int = 0) -> list[DeliveredMessage]:
    """Consumes ``queue`` on ``channel`` into a list (nothing acked)."""
    got: list[DeliveredMessage] = []

    async def put(message: DeliveredMessage) -> None:
        got.append(message)

    await channel.basic_qos(prefetch_count=prefetch)
    await channel.basic_consume(queue, put)
    return got


async def tiered(channel: AbstractChannel, queue_type: str = "quorum", ttl: int = 1000) -> None:
    """``q`` dead-letters to ``q.retry`` (key ``q``) -> ``q.tier`` (TTL) -> back to ``q``."""
    kind = QUORUM if queue_type == "quorum" else {"x-queue-type": "classic"}
    await channel.exchange_declare("q.retry", exchange_type="direct", durable=True)
    await channel.queue_declare("q", durable=True, arguments={
        **kind, "x-dead-letter-exchange": "q.retry", "x-dead-letter-routing-key": "q"})
    await channel.queue_declare("q.tier", durable=True, arguments={
        **kind, "x-message-ttl": ttl, "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "q"})
    await channel.queue_bind("q.tier", "q.retry", routing_key="q")


# --- what real brokers were seen to do -----------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_redelivery_counts_match_what_the_real_broker_sent(version: str) -> None:
    """The capture the real brokers ran (tests/support/deliveries.py), run on the fake."""
    async with TestBroker(None, version=version) as broker:
        seen = await capture_on(await broker.connect(), lambda: broker.advance(0.1))
    expected = json.loads((FIXTURES / f"deliveries-{version}.json").read_text())
    assert seen == expected


# --- routing -------------------------------------------------------------------------------------


async def test_exchanges_route_as_their_type_says(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    for kind in ("direct", "topic", "fanout", "headers"):
        await channel.exchange_declare(kind, exchange_type=kind, durable=True)
    for name in ("a", "b", "c"):
        await channel.queue_declare(name, durable=True)
    await channel.queue_bind("a", "direct", routing_key="k")
    await channel.queue_bind("a", "topic", routing_key="order.*")
    await channel.queue_bind("b", "topic", routing_key="#.cancelled")
    await channel.queue_bind("c", "topic", routing_key="order.#")
    await channel.queue_bind("a", "fanout")
    await channel.queue_bind("b", "fanout")
    await channel.queue_bind("a", "headers", arguments={"x-match": "all", "t": "x", "u": 1})
    await channel.queue_bind("b", "headers", arguments={"x-match": "any", "t": "x", "u": 1})
    publish = empty.publish
    assert publish(exchange="direct", routing_key="k") == ["a"]
    assert publish(exchange="topic", routing_key="order.created") == ["a", "c"]
    assert publish(exchange="topic", routing_key="order.eu.cancelled") == ["b", "c"]
    assert publish(exchange="topic", routing_key="order") == ["c"]  # '#' matches zero words
    assert publish(exchange="topic", routing_key="cancelled") == ["b"]
    assert publish(exchange="fanout", routing_key="whatever") == ["a", "b"]
    assert publish(exchange="headers", headers={"t": "x", "u": 1}) == ["a", "b"]
    assert publish(exchange="headers", headers={"t": "x"}) == ["b"]
    assert publish(queue="c") == ["c"]  # the default exchange
    with pytest.raises(Unroutable, match="nothing is bound to exchange 'direct' with routing "
                                         "key 'other'"):
        publish(exchange="direct", routing_key="other")
    with pytest.raises(Unroutable, match="no exchange 'nope' in vhost '/'"):
        publish(exchange="nope", routing_key="k")
    depths = {name: len(empty.messages(name)) for name in ("a", "b", "c")}
    assert depths == {"a": 4, "b": 5, "c": 4}  # nothing counted for the two refusals


async def test_an_alternate_exchange_takes_what_its_exchange_cannot_route(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty)
    await channel.exchange_declare("spill", exchange_type="fanout", durable=True)
    await channel.exchange_declare("main", exchange_type="direct", durable=True,
                                   arguments={"alternate-exchange": "spill"})
    await channel.queue_declare("routed", durable=True)
    await channel.queue_declare("spilled", durable=True)
    await channel.queue_bind("routed", "main", routing_key="k")
    await channel.queue_bind("spilled", "spill")
    assert empty.publish(exchange="main", routing_key="k") == ["routed"]
    assert empty.publish(exchange="main", routing_key="other") == ["spilled"]


async def test_an_exchange_bound_to_an_exchange_routes_on_with_the_same_key(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty)
    await channel.exchange_declare("events", exchange_type="topic", durable=True)
    await channel.exchange_declare("points", exchange_type="direct", durable=True)
    await channel.queue_declare("p", durable=True)
    await channel.queue_declare("all", durable=True)
    await channel.exchange_bind("points", "events", routing_key="points.*")
    await channel.queue_bind("p", "points", routing_key="points.earned")
    await channel.queue_bind("all", "events", routing_key="#")
    await channel.exchange_bind("events", "points", routing_key="points.earned")  # a cycle
    assert empty.publish(exchange="events", routing_key="points.earned") == ["all", "p"]
    assert empty.publish(exchange="events", routing_key="points.spent") == ["all"]
    await channel.exchange_unbind("points", "events", routing_key="points.*")
    assert empty.publish(exchange="events", routing_key="points.earned") == ["all"]
    assert [len(empty.messages(q)) for q in ("p", "all")] == [1, 3]  # each queue once


@pytest.mark.parametrize("hash_on", ["routing key", "header"])
async def test_a_consistent_hash_exchange_keeps_each_key_on_one_queue(
    empty: TestBroker, hash_on: str
) -> None:
    channel = await channel_of(empty)
    arguments = {"hash-header": "user-id"} if hash_on == "header" else None
    await channel.exchange_declare("lanes", exchange_type="x-consistent-hash", durable=True,
                                   arguments=arguments)
    for lane in range(4):
        await channel.queue_declare(f"lane.{lane}", durable=True)
        await channel.queue_bind(f"lane.{lane}", "lanes", routing_key="1")  # weight 1

    def send(key: str) -> list[str]:
        if hash_on == "header":
            return empty.publish(exchange="lanes", routing_key="any", headers={"user-id": key})
        return empty.publish(exchange="lanes", routing_key=key)

    first = {f"u{i}": send(f"u{i}") for i in range(200)}
    assert all(len(queues) == 1 for queues in first.values())
    assert all(send(key) == queues for key, queues in first.items())  # stable per key
    spread = {queues[0] for queues in first.values()}
    assert spread == {"lane.0", "lane.1", "lane.2", "lane.3"}  # and spread over all of them


async def test_only_the_single_active_consumer_gets_deliveries_until_it_goes(
    empty: TestBroker,
) -> None:
    first_channel, second_channel = await channel_of(empty), await channel_of(empty)
    await first_channel.queue_declare("sac", durable=True, arguments={
        **QUORUM, "x-single-active-consumer": True})
    first = await taker(first_channel, "sac", prefetch=10)
    second = await taker(second_channel, "sac", prefetch=10)
    for i in range(3):
        empty.publish(queue="sac", body=str(i))
    await empty.settle()
    assert ([m.body for m in first], second) == ([b"0", b"1", b"2"], [])
    await first_channel.basic_ack(first[0].delivery.delivery_tag)
    await first_channel.close()  # 1 and 2 go back, and the second consumer takes over
    empty.publish(queue="sac", body="3")
    await empty.settle()
    assert [m.body for m in second] == [b"1", b"2", b"3"]
    assert [m.redelivered for m in second] == [True, True, False]


# --- publishing: confirms, returns, refusals -----------------------------------------------------


async def test_a_confirmed_publish_is_acked_and_an_unroutable_mandatory_one_raises(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty, publisher_confirms=True, on_return_raises=True)
    await channel.queue_declare("q", durable=True)
    confirm = await channel.basic_publish(b"x", routing_key="q", mandatory=True)
    assert isinstance(confirm, spec.Basic.Ack)
    with pytest.raises(aiormq.exceptions.PublishError) as raised:
        await channel.basic_publish(b"y", routing_key="missing", mandatory=True)
    assert raised.value.message.body == b"y"
    # Not mandatory: the broker drops it and still confirms.
    assert isinstance(await channel.basic_publish(b"z", routing_key="missing"), spec.Basic.Ack)
    assert [m.body for m in empty.messages("q")] == [b"x"]
    assert not channel.is_closed


async def test_without_on_return_raises_the_return_callbacks_get_the_message(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty, publisher_confirms=True, on_return_raises=False)
    returned: list[DeliveredMessage] = []
    channel.on_return_callbacks.add(returned.append)
    await channel.basic_publish(b"y", routing_key="missing", mandatory=True)
    assert [(m.body, m.delivery.reply_text) for m in returned] == [(b"y", "NO_ROUTE")]


async def test_a_full_reject_publish_queue_nacks_the_publish(empty: TestBroker) -> None:
    channel = await channel_of(empty, publisher_confirms=True)
    await channel.queue_declare("q", durable=True, arguments={
        **QUORUM, "x-max-length": 1})
    await channel.basic_publish(b"1", routing_key="q")
    with pytest.raises(aiormq.exceptions.DeliveryError) as refused:
        await channel.basic_publish(b"2", routing_key="q")
    assert isinstance(refused.value.frame, spec.Basic.Nack)
    assert [m.body for m in empty.messages("q")] == [b"1"]


async def test_a_full_classic_queue_drops_its_head_by_default(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True, arguments={"x-max-length": 2})
    for body in (b"1", b"2", b"3"):
        await channel.basic_publish(body, routing_key="q")
    assert [m.body for m in empty.messages("q")] == [b"2", b"3"]
    assert [(d.queue, d.reason) for d in empty.discarded] == [
        ("q", "maxlen, and the queue has no dead-letter exchange")]


async def test_refusals_close_the_channel_as_rabbitmq_does(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity) as missing:
        await channel.basic_publish(b"x", exchange="nope", routing_key="k")
    assert str(missing.value) == "NOT_FOUND - no exchange 'nope' in vhost '/'"
    assert channel.is_closed
    with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
        await channel.basic_publish(b"x", routing_key="k")

    channel = await channel_of(empty)
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed,
                       match="user_id property set to 'someone' but authenticated user was "
                             "'guest'"):
        await channel.basic_publish(b"x", routing_key="k",
                                    properties=spec.Basic.Properties(user_id="someone"))
    assert channel.is_closed

    channel = await channel_of(empty)
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="invalid expiration"):
        await channel.basic_publish(b"x", routing_key="k",
                                    properties=spec.Basic.Properties(expiration="-5"))
    assert channel.is_closed


async def test_a_content_header_beyond_the_frame_size_closes_the_connection(
    empty: TestBroker,
) -> None:
    connection = await empty.connect()
    channel = await connection.channel()
    huge = {"h": "x" * (connection.connection_tune.frame_max + 1)}
    with pytest.raises(aiormq.exceptions.ConnectionFrameError):
        await channel.basic_publish(b"", routing_key="k",
                                    properties=copy_properties(spec.Basic.Properties(), huge))
    assert connection.is_closed
    assert connection.closing.done()


async def test_passive_declares_say_what_is_missing_as_rabbitmq_words_it(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty)
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity) as missing:
        await channel.queue_declare("nope", passive=True)
    assert is_missing(str(missing.value))
    assert channel.is_closed
    assert isinstance(channel.closing.exception(), aiormq.exceptions.ChannelNotFoundEntity)
    channel = await channel_of(empty)
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity) as missing:
        await channel.exchange_declare("nope", passive=True)
    assert str(missing.value) == "NOT_FOUND - no exchange 'nope' in vhost '/'"
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True, arguments={"x-message-ttl": 5})
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="inequivalent arg "
                                                                          "'x-message-ttl'"):
        await channel.queue_declare("q", durable=True)


# --- the wire ------------------------------------------------------------------------------------


async def test_headers_cross_the_wire_as_their_encoder_wrote_them(empty: TestBroker) -> None:
    """pamqp (what aio-pika producers send) writes floats as 32-bit; the worker's copies
    (``rabbit_retry.wire``) keep doubles and byte strings: the consumer reads each as it was."""
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    stamp = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    values = {"n": 7, "s": "text", "d": Decimal("1.25"), "t": stamp, "list": [1, "a"],
              "table": {"k": True}, "none": None}
    await channel.basic_publish(b"1", routing_key="q",
                                properties=spec.Basic.Properties(headers={**values, "f": 0.1}))
    ours = {**values, "f": 0.1, "raw": b"\xff\xfe"}
    await channel.basic_publish(b"2", routing_key="q",
                                properties=copy_properties(spec.Basic.Properties(), ours))
    got = await taker(channel, "q")
    await empty.settle()
    pamqp_sent, copy_sent = (m.header.properties.headers for m in got)
    assert pamqp_sent["f"] != 0.1 and abs(pamqp_sent["f"] - 0.1) < 1e-7  # float32 on the wire
    assert {k: v for k, v in pamqp_sent.items() if k != "f"} == values
    assert copy_sent == ours
    with pytest.raises(TypeError):  # pamqp cannot send a byte string: nor can a producer
        await channel.basic_publish(b"3", routing_key="q",
                                    properties=spec.Basic.Properties(headers={"raw": b"\xff"}))


# --- settling ------------------------------------------------------------------------------------


async def test_prefetch_holds_back_deliveries_until_acks_free_credit(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    for i in range(5):
        empty.publish(queue="q", body=str(i))
    got = await taker(channel, "q", prefetch=2)
    await empty.settle()
    assert [m.body for m in got] == [b"0", b"1"]
    await channel.basic_ack(got[1].delivery.delivery_tag, multiple=True)  # both at once
    await empty.settle()
    assert [m.body for m in got] == [b"0", b"1", b"2", b"3"]
    await channel.basic_ack(got[2].delivery.delivery_tag)
    await empty.settle()
    assert [m.body for m in got] == [b"0", b"1", b"2", b"3", b"4"]
    assert [d.verdict for d in empty.decisions] == ["acked", "acked", "acked"]
    assert not channel.is_closed


async def test_an_unknown_delivery_tag_closes_the_channel_and_returns_its_deliveries(
    empty: TestBroker,
) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    empty.publish(queue="q", body="x")
    got = await taker(channel, "q")
    await empty.settle()
    tag = got[0].delivery.delivery_tag
    await channel.basic_ack(tag)
    await channel.basic_ack(tag)  # twice: RabbitMQ closes the channel
    assert channel.is_closed
    assert "unknown delivery tag" in str(channel.closing.exception())
    empty.publish(queue="q", body="y")
    channel = await channel_of(empty)
    got = await taker(channel, "q")
    await empty.settle()
    await channel.basic_ack(got[0].delivery.delivery_tag + 1)
    assert channel.is_closed
    [back] = empty.messages("q")
    assert (back.body, back.redelivered) == (b"y", True)


async def test_requeue_and_reject_settle_as_asked(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    empty.publish(queue="q", body="a")
    empty.publish(queue="q", body="b")
    got = await taker(channel, "q", prefetch=2)
    await empty.settle()
    await channel.basic_cancel(next(iter(channel.consumers)))
    await channel.basic_nack(got[0].delivery.delivery_tag, requeue=True)
    await channel.basic_reject(got[1].delivery.delivery_tag, requeue=False)
    assert [d.verdict for d in empty.decisions] == ["requeued", "dead-lettered"]
    assert [(m.body, m.redelivered) for m in empty.messages("q")] == [(b"a", True)]
    assert [d.reason for d in empty.discarded] == [
        "rejected, and the queue has no dead-letter exchange"]


async def test_a_nack_with_multiple_settles_every_tag_up_to_it(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    for body in ("a", "b", "c"):
        empty.publish(queue="q", body=body)
    got = await taker(channel, "q", prefetch=3)
    await empty.settle()
    await channel.basic_nack(got[1].delivery.delivery_tag, multiple=True, requeue=False)
    assert [d.message.body for d in empty.decisions] == [b"a", b"b"]
    assert [(d.queue, d.content.body) for d in empty.discarded] == [("q", b"a"), ("q", b"b")]
    await channel.basic_cancel(next(iter(channel.consumers)))  # so that "c" stays in the queue
    await channel.basic_nack(got[2].delivery.delivery_tag, multiple=True, requeue=True)
    await empty.settle()
    assert [(m.body, m.redelivered) for m in empty.messages("q")] == [(b"c", True)]


async def test_a_deleted_queue_cancels_its_consumers(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    cancelled: list[str] = []

    async def heard(frame: spec.Basic.Cancel) -> None:
        cancelled.append(frame.consumer_tag)

    channel.on_consumer_cancel_callbacks.add(heard)
    await taker(channel, "q")
    [tag] = channel.consumers
    await (await channel_of(empty)).queue_delete("q")
    await empty.settle()
    assert cancelled == [tag]
    assert not channel.consumers


# --- dead-lettering ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_rejected_message_carries_its_history_as_the_version_writes_it(
    version: str,
) -> None:
    async with TestBroker(None, version=version, start=START) as broker:
        channel = await channel_of(broker)
        await tiered(channel, ttl=5000)
        broker.publish(queue="q", body="x", message_id="m", headers={"app": "kept"})
        got = await taker(channel, "q")
        await broker.settle()
        await channel.basic_nack(got[0].delivery.delivery_tag, requeue=False)
        [decision] = await broker.settle()
        assert (decision.verdict, decision.to) == ("dead-lettered", "q.tier")
        [waiting] = broker.messages("q.tier")
        assert broker.messages("q") == []
        await broker.advance(4.999)
        assert len(broker.messages("q.tier")) == 1  # its TTL has not run out yet
        await broker.advance(0.001)
        assert broker.messages("q.tier") == []
        back = got[1].header.properties.headers
    assert back["app"] == "kept"
    deaths = back["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [
        ("q.tier", "expired", 1), ("q", "rejected", 1)]
    rejected = deaths[1]
    assert (rejected["exchange"], rejected["routing-keys"]) == ("", ["q"])
    assert rejected["time"] == START.replace(microsecond=0)
    assert (deaths[0]["exchange"], deaths[0]["routing-keys"]) == ("q.retry", ["q"])
    assert deaths[0]["time"] == START + datetime.timedelta(seconds=5)
    assert (back["x-first-death-queue"], back["x-first-death-reason"]) == ("q", "rejected")
    if version == "3.10":  # x-last-death-* came with 3.13
        assert not any(k.startswith("x-last-death") for k in back)
    else:
        assert (back["x-last-death-queue"], back["x-last-death-reason"]) == ("q.tier", "expired")
        assert list(back) == sorted(back)  # 4.x sorts the table once it adds to it
    assert waiting.headers["x-death"][0]["queue"] == "q"


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_second_death_counts_on_and_moves_to_the_front(version: str) -> None:
    async with TestBroker(None, version=version, start=START) as broker:
        channel = await channel_of(broker, publisher_confirms=False)
        await tiered(channel, queue_type="classic", ttl=10)
        broker.publish(queue="q", body="x")
        got = await taker(channel, "q")
        for round_ in range(2):
            await broker.settle()
            await channel.basic_reject(got[round_].delivery.delivery_tag, requeue=False)
            await broker.advance(0.01)
        deaths = got[2].header.properties.headers["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [
        ("q.tier", "expired", 2), ("q", "rejected", 2)]


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_per_message_ttl_expires_at_its_time_and_is_noted_when_dead_lettered(
    version: str,
) -> None:
    async with TestBroker(None, version=version, start=START) as broker:
        channel = await channel_of(broker)
        await tiered(channel, queue_type="classic", ttl=60_000)
        await channel.queue_unbind("q.tier", "q.retry", routing_key="q")
        await channel.queue_declare("expired", durable=True)
        await channel.queue_bind("expired", "q.retry", routing_key="q")
        broker.publish(queue="q", body="short", expiration=1000)
        await broker.advance(0.999)
        assert len(broker.messages("q")) == 1
        await broker.advance(0.001)
        [dead] = broker.messages("expired")
    assert dead.properties.expiration is None
    [death] = dead.headers["x-death"]
    assert (death["reason"], death["original-expiration"]) == ("expired", "1000")


async def test_a_message_expires_only_at_the_head_of_its_queue(empty: TestBroker) -> None:
    channel = await channel_of(empty)
    await channel.queue_declare("q", durable=True)
    empty.publish(queue="q", body="long", expiration=10_000)
    empty.publish(queue="q", body="short", expiration=1000)
    await empty.advance(5)
    assert [m.body for m in empty.messages("q")] == [b"long", b"short"]
    await empty.advance(5)
    assert empty.messages("q") == []  # both went as the head went


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_dead_letter_cycle_without_a_rejection_drops_the_message(version: str) -> None:
    """Past its delivery limit a message dies into the tier and cannot come back: the worker
    must never let it get there (docs/versions.md)."""
    async with TestBroker(None, version=version, start=START) as broker:
        connection = await broker.connect()
        channel = await connection.channel()
        await tiered(channel, ttl=100)
        await channel.queue_delete("q")
        await channel.queue_declare("q", durable=True, arguments={
            **QUORUM, "x-dead-letter-exchange": "q.retry", "x-dead-letter-routing-key": "q",
            "x-delivery-limit": 1})
        broker.publish(queue="q", body="poison")
        for _ in range(2):  # two returns: one past the limit of 1
            taking = await connection.channel()
            await taker(taking, "q")
            await broker.settle()
            await taking.close()
        assert [(m.headers["x-death"][0]["reason"]) for m in broker.messages("q.tier")] == [
            "delivery_limit"]
        await broker.advance(0.1)
        assert broker.messages("q") == broker.messages("q.tier") == []
    [lost] = broker.discarded
    assert "dead-letter cycle back into 'q'" in lost.reason


# --- redelivery ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_closed_channel_returns_its_deliveries_counted_as_the_version_counts(
    version: str,
) -> None:
    async with TestBroker(None, version=version) as broker:
        connection = await broker.connect()
        setup = await connection.channel()
        await setup.queue_declare("quorum", durable=True, arguments=QUORUM)
        await setup.queue_declare("classic", durable=True)
        for queue in ("quorum", "classic"):
            broker.publish(queue=queue, body=queue)
        for _ in range(2):
            channel = await connection.channel()
            await taker(channel, "quorum")
            await taker(channel, "classic")
            await broker.settle()
            await channel.close()
        assert [d.verdict for d in broker.decisions] == ["unsettled"] * 4
        [quorum] = broker.messages("quorum")
        [classic] = broker.messages("classic")
    assert quorum.redelivered and classic.redelivered
    assert quorum.headers["x-delivery-count"] == 2
    assert "x-delivery-count" not in classic.headers
    assert ("x-acquired-count" in quorum.headers) == (version == "4.3")


@pytest.mark.parametrize("version", VERSIONS)
async def test_publishing_a_redelivery_puts_it_back_as_a_crash_would(version: str) -> None:
    async with TestBroker(None, version=version) as broker:
        setup = await channel_of(broker)
        await setup.queue_declare("quorum", durable=True, arguments=QUORUM)
        await setup.queue_declare("classic", durable=True)
        broker.publish(queue="quorum", body="q", redelivered=3)
        broker.publish(queue="classic", body="c", redelivered=True)
        [quorum] = broker.messages("quorum")
        [classic] = broker.messages("classic")
    assert (quorum.redelivered, quorum.headers["x-delivery-count"]) == (True, 3)
    assert (classic.redelivered, classic.headers) == (True, {})


@pytest.mark.parametrize("version", VERSIONS)
async def test_past_its_delivery_limit_a_quorum_message_is_dead_lettered(version: str) -> None:
    async with TestBroker(None, version=version) as broker:
        setup = await channel_of(broker)
        await tiered(setup)
        await setup.queue_delete("q")
        await setup.queue_declare("q", durable=True, arguments={
            **QUORUM, "x-dead-letter-exchange": "q.retry", "x-dead-letter-routing-key": "q",
            "x-delivery-limit": 2})
        broker.publish(queue="q", body="x", redelivered=2)
        assert len(broker.messages("q")) == 1
        broker.publish(queue="q", body="y", redelivered=3)
        [dead] = broker.messages("q.tier")
    assert dead.body == b"y"
    assert dead.headers["x-death"][0]["reason"] == "delivery_limit"


async def test_4_x_quorum_queues_limit_returns_to_20_by_default() -> None:
    async with TestBroker(None, version="4.3") as broker:
        setup = await channel_of(broker)
        await setup.queue_declare("q", durable=True, arguments=QUORUM)
        broker.publish(queue="q", body="kept", redelivered=20)
        broker.publish(queue="q", body="dropped", redelivered=21)
        assert [m.body for m in broker.messages("q")] == [b"kept"]
    [lost] = broker.discarded
    assert lost.reason == "delivery_limit, and the queue has no dead-letter exchange"


# --- the virtual clock ---------------------------------------------------------------------------


async def test_the_clock_moves_only_when_told(empty: TestBroker) -> None:
    assert empty.now == START
    await empty.advance(90)
    assert empty.now == START + datetime.timedelta(seconds=90)
    await empty.settle(retries=True)  # nothing waits: the clock stays
    assert empty.now == START + datetime.timedelta(seconds=90)


async def test_a_connection_closed_by_the_broker_says_so(empty: TestBroker) -> None:
    connection: Connection = await empty.connect()
    channel = await connection.channel()
    closing = channel.closing
    empty.disconnect()
    assert connection.is_closed and channel.is_closed
    with pytest.raises(aiormq.exceptions.ConnectionClosed, match="CONNECTION_FORCED"):
        await closing
    with pytest.raises(RuntimeError):
        await connection.channel()
