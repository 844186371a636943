"""The outbox's pure core: which destinations a topology offers, an event as ``add`` checks and
writes it, a stored event as the relay publishes it, the retry schedule and the broker's
reasons, and the trace context an event carries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiormq.exceptions
import pytest
from pamqp import commands as spec

from rabbit_retry.outbox import Outbox, UnknownDestination
from rabbit_retry.outbox.decide import RetryPolicy, channel_refusal, refusal
from rabbit_retry.outbox.destinations import Destinations, destination_name
from rabbit_retry.outbox.event import outgoing
from rabbit_retry.topology import parse_topology

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
  internal-only: {type: fanout, internal: true}
queues:
  shop.orders:
    bindings: [{exchange: shop, routing_key: "order.*"}, {exchange: amq.topic, routing_key: x}]
  shop.audit:
    bindings: [{exchange: internal-only}]
"""


@pytest.fixture
def outbox(tmp_path: Path) -> Outbox:
    path = tmp_path / "shop.yml"
    path.write_text(TOPOLOGY)
    return Outbox(path)


def test_destinations_are_the_files_exchanges_bound_builtins_and_main_queues() -> None:
    found = Destinations.of(parse_topology(TOPOLOGY, "shop.yml"))
    assert found.exchanges == {"shop", "amq.topic"}  # internal exchanges take no publish
    assert found.queues == {"shop.orders", "shop.audit"}
    assert found.resolve("shop", "order.created", None) == ("shop", "order.created")
    assert found.resolve(None, None, "shop.audit") == ("", "shop.audit")
    assert found.resolve("", "shop.orders", None) == ("", "shop.orders")
    assert destination_name("shop", "order.created") == "shop"
    assert destination_name("", "shop.audit") == "shop.audit"


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"exchange": "internal-only", "routing_key": ""}, UnknownDestination,
     "exchange 'internal-only' is not declared in shop.yml (its exchanges: amq.topic, shop); "
     "nothing was written"),
    ({"exchange": "amq.direct", "routing_key": "x"}, UnknownDestination,
     "exchange 'amq.direct' is not declared in shop.yml (its exchanges: amq.topic, shop); "
     "nothing was written"),
    ({"queue": "shop.orders.parking"}, UnknownDestination,
     "queue 'shop.orders.parking' is not a queue of shop.yml (its queues: shop.audit, "
     "shop.orders); nothing was written"),
    ({"exchange": "", "routing_key": "nope"}, UnknownDestination,
     "queue 'nope' is not a queue of shop.yml (its queues: shop.audit, shop.orders); nothing "
     "was written"),
    ({}, ValueError, "name a destination: exchange= (with routing_key=) or queue="),
    ({"queue": "shop.orders", "routing_key": "other"}, ValueError,
     "queue='shop.orders': an event to a queue takes no routing_key (the queue's name is its "
     "routing key)"),
    ({"exchange": "shop", "routing_key": "k" * 256}, ValueError,
     "routing_key: at most 255 bytes"),
    ({"exchange": 7, "routing_key": "x"}, TypeError, "exchange: a str, got int"),
])
def test_a_destination_the_file_does_not_offer_is_refused_in_one_line(
    arguments: dict[str, Any], error: type[Exception], message: str,
) -> None:
    found = Destinations.of(parse_topology(TOPOLOGY, "shop.yml"))
    with pytest.raises(error) as refused:
        found.resolve(arguments.get("exchange"), arguments.get("routing_key"),
                      arguments.get("queue"))
    assert str(refused.value) == message
    assert issubclass(UnknownDestination, ValueError)


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"message_id": ""}, ValueError, "message_id: 1 to 255 bytes, got 0"),
    ({"message_id": "m" * 256}, ValueError, "message_id: 1 to 255 bytes, got 256"),
    ({"message_id": 42}, TypeError, "message_id: a str, got int"),
    ({"key": 7}, TypeError, "key: a str, got int"),
    ({"key": "k" * 1025}, ValueError, "key: 1 to 1024 bytes, got 1025"),
    ({"body": {"a": 1}}, TypeError, "body: bytes or str, got dict"),
    ({"headers": {"when": object()}}, TypeError,
     "headers: cannot encode a object as an AMQP field value"),
    ({"headers": {1: "x"}}, TypeError, "headers: names are str, got 1"),
    ({"priority": 300}, ValueError, "priority: an int from 0 to 255, got 300"),
    ({"delivery_mode": 3}, ValueError, "delivery_mode: 1 (transient) or 2 (persistent), got 3"),
    ({"expiration": "1.5"}, ValueError, "expiration: whole milliseconds, got '1.5'"),
    ({"content_type": b"json"}, TypeError, "content_type: a str, got bytes"),
    ({"timestamp": "today"}, TypeError,
     "timestamp: a datetime or seconds since the epoch, got 'today'"),
])
def test_an_event_amqp_could_not_carry_is_refused_before_anything_is_written(
    outbox: Outbox, arguments: dict[str, Any], error: type[Exception], message: str,
) -> None:
    given = {"exchange": "shop", "routing_key": "order.created", "body": b"{}", **arguments}
    with pytest.raises(error) as refused:
        outbox.event(**given)
    assert str(refused.value) == message


def test_an_unknown_property_is_a_type_error(outbox: Outbox) -> None:
    with pytest.raises(TypeError, match="unknown message property 'user_id'"):
        outbox.event(exchange="shop", routing_key="x", body=b"", user_id="someone")  # type: ignore[call-arg]


def test_a_stored_event_goes_out_with_exactly_the_headers_and_properties_it_was_added_with(
    outbox: Outbox,
) -> None:
    headers = {"tenant": "acme", "ratio": 0.1, "raw": b"\xff\xfe", "n": 2**40,
               "nested": {"a": [1, "b", None]}, "price": Decimal("12.50"), "flag": True}
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    event = outbox.event(exchange="shop", routing_key="order.created", body="héllo",
                         message_id="m-1", key="customer-7", headers=headers,
                         content_type="text/plain", content_encoding="utf-8",
                         correlation_id="c-1", reply_to="replies", expiration=60000,
                         priority=5, timestamp=when, type="OrderCreated", app_id="shop",
                         delivery_mode=1)
    assert (event.exchange, event.routing_key, event.message_id, event.order_key) == (
        "shop", "order.created", "m-1", "customer-7")
    assert event.body == "héllo".encode()
    body, properties = outgoing(event.message_id, event.body, event.headers, event.properties,
                                event.trace)
    assert body == "héllo".encode()
    # The wire form, decoded as a consumer's client decodes it.
    decoded = spec.Basic.Properties()
    decoded.unmarshal(*_flags_and_data(properties))
    assert decoded.headers == headers
    assert (decoded.content_type, decoded.content_encoding, decoded.correlation_id,
            decoded.reply_to, decoded.expiration, decoded.priority, decoded.message_type,
            decoded.app_id, decoded.delivery_mode, decoded.message_id) == (
        "text/plain", "utf-8", "c-1", "replies", "60000", 5, "OrderCreated", "shop", 1, "m-1")
    assert decoded.timestamp == when


def _flags_and_data(properties: spec.Basic.Properties) -> tuple[int, bytes]:
    raw = properties.marshal()
    return int.from_bytes(raw[:2], "big"), raw[2:]


def test_an_event_without_message_id_gets_one_and_is_persistent(outbox: Outbox) -> None:
    one = outbox.event(queue="shop.orders", body=b"")
    two = outbox.event(queue="shop.orders", body=b"")
    assert len(one.message_id) == 32 and one.message_id != two.message_id
    assert (one.headers, one.properties, one.order_key) == (None, None, None)
    _, properties = outgoing(one.message_id, one.body, None, None, None)
    assert (properties.delivery_mode, properties.headers) == (2, None)


def test_the_trace_context_of_the_add_goes_out_as_headers(outbox: Outbox) -> None:
    from opentelemetry import context, trace

    span = trace.NonRecordingSpan(trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
        is_remote=False, trace_flags=trace.TraceFlags(1)))
    token = context.attach(trace.set_span_in_context(span))
    try:
        event = outbox.event(exchange="shop", routing_key="x", body=b"", headers={"a": 1})
        own = outbox.event(exchange="shop", routing_key="x", body=b"",
                           headers={"traceparent": "mine"})
    finally:
        context.detach(token)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert event.trace is not None and json.loads(event.trace) == {"traceparent": parent}
    _, properties = outgoing(event.message_id, event.body, event.headers, event.properties,
                             event.trace)
    assert properties.headers == {"a": 1, "traceparent": parent}
    assert own.trace is None  # the application's own traceparent header wins
    outside = outbox.event(exchange="shop", routing_key="x", body=b"")
    assert outside.trace is None  # no span: nothing to carry


def test_adding_events_imports_no_opentelemetry_sqlalchemy_or_relay(tmp_path: Path) -> None:
    (tmp_path / "shop.yml").write_text(TOPOLOGY)
    code = textwrap.dedent(f"""
        import sqlite3, sys
        from rabbit_retry.outbox import Outbox
        conn = sqlite3.connect(":memory:")
        conn.execute("CREATE TABLE rabbit_retry_outbox (exchange, routing_key, message_id, "
                     "order_key, body, headers, properties, trace)")
        Outbox({str(tmp_path / "shop.yml")!r}).add(conn, queue="shop.orders", body=b"x")
        assert conn.execute("SELECT count(*) FROM rabbit_retry_outbox").fetchone() == (1,)
        loaded = [m for m in ("opentelemetry", "sqlalchemy", "alembic", "prometheus_client",
                              "aio_pika", "rabbit_retry.outbox.relay") if m in sys.modules]
        print(",".join(loaded))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_a_failed_event_waits_longer_each_time_then_dies() -> None:
    policy = RetryPolicy(attempts=4, first_delay=5.0, max_delay=12.0)
    waits = [policy.after_failure(n) for n in (1, 2, 3)]
    assert [status for status, _ in waits] == ["failed"] * 3
    # Jittered within the upper half of 5, 10, min(20, 12).
    for (_, wait), ceiling in zip(waits, (5.0, 10.0, 12.0), strict=True):
        assert wait is not None and ceiling / 2 <= wait <= ceiling
    assert policy.after_failure(4) == ("dead", None)
    assert RetryPolicy(attempts=1).after_failure(1) == ("dead", None)
    with pytest.raises(ValueError, match="attempts: at least 1, got 0"):
        RetryPolicy(attempts=0)


def test_the_brokers_verdicts_as_an_events_error() -> None:
    returned = spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="shop",
                                 routing_key="refund")
    message = type("Returned", (), {"delivery": returned})()
    error = aiormq.exceptions.PublishError(message, returned)  # type: ignore[arg-type]
    assert refusal(error, "shop", "refund") == (
        "unroutable: no queue bound to exchange 'shop' takes routing key 'refund' (the broker "
        "returned it: 312 NO_ROUTE)")
    assert refusal(error, "", "gone") == (
        "unroutable: no queue bound to the default exchange takes routing key 'gone' (the "
        "broker returned it: 312 NO_ROUTE)")
    nacked = aiormq.exceptions.DeliveryError(None, spec.Basic.Nack(delivery_tag=1))
    assert refusal(nacked, "shop", "x") == (
        "the broker refused it (basic.nack): a queue it routes to is full (x-overflow "
        "reject-publish) or has no leader")
    closed = aiormq.exceptions.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - message size 20000000 is larger than configured max size "
        "16777216")
    assert refusal(closed, "shop", "x") is None  # the channel's error: no verdict on the event
    assert channel_refusal(closed) == (
        "the broker closed the channel: PRECONDITION_FAILED - message size 20000000 is larger "
        "than configured max size 16777216")
