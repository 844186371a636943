"""A publisher's headers come back byte for byte, with their AMQP types, from every copy the
product makes on a real broker: the retry tier's copy, the parked copy and the replayed one
(``rabbit-retry parking replay``). The bytes compared are the ones that came off the socket
(``support.fieldtables.captured_headers``), never a decoded view of them.

Three publishers: generated tables of every field type RabbitMQ passes on (sent byte by byte),
Python's ``pika`` (whose own codec writes every int as ``I``; extended here to write the types
it lacks) and Node's ``amqplib`` (which writes every type but ``L``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.amqp import blocking, drain_sync, publish_raw
from support.fieldtables import RawHeaders, Seen, captured_headers, split, tables
from support.provision import provision, topology
from support.tools import in_ci, require
from support.vhosts import delete_vhost
from support.worker import run_until_parked

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, RetryConsumer

# Two delays: the worker publishes the retry copy itself (one delay may be the broker's nack).
TOPOLOGY = """
version: 1
exchanges: {orders: {type: topic}}
queues:
  orders:
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [100ms, 200ms], max_attempts: 2}
"""
NODE_MODULES = Path(os.environ.get(
    "RABBIT_RETRY_NODE_MODULES", Path.home() / ".cache" / "rabbit-retry" / "node" / "node_modules"
))
AMQPLIB_PUBLISH = Path(__file__).parents[1] / "support" / "node" / "amqplib_publish.js"


class AlwaysFails(RetryConsumer):
    """Fails every attempt: each message takes the tier once, then parks."""

    queue = "orders"
    prefetch = 20

    def __init__(self) -> None:
        self.seen: dict[str | None, list[dict[str, Any]]] = {}

    async def handle(self, delivery: Delivery) -> None:
        self.seen.setdefault(delivery.message_id, []).append(dict(delivery.headers))
        raise ValueError("downstream down")


def through_the_product(
    settings: Settings, run_cli: Callable[..., Any], publish: Callable[[], None], count: int
) -> tuple[list[Seen], list[Any]]:
    """Publish (``publish``), let the worker retry and park every message, replay them all with
    the CLI, then take them off the main queue: every content header frame this process read
    on the way, and the replayed messages."""
    blocking(provision(settings, topology(TOPOLOGY)))
    publish()

    with captured_headers() as seen:
        run_until_parked([AlwaysFails()], topology(TOPOLOGY), settings, "orders", count)
        done = run_cli("parking", "replay", "orders", "--yes", settings=settings)
        assert done.code == 0, done.err
        replayed = drain_sync(settings, "orders")
    assert len(replayed) == count
    return seen, replayed


def assert_kept(seen: list[Seen], message_id: str, sent: bytes) -> None:
    """Every frame of ``message_id`` (first delivery, the tier's copy back, the parked copy, the
    replayed one) carries the sent headers with the same bytes. In name order: RabbitMQ sorts a
    table by name (4.x always, 3.10 on quorum queues; docs/versions.md)."""
    frames = [s for s in seen if s.message_id == message_id]
    sent_fields = split(sent)
    names = {name for name, _ in sent_fields}
    stages = {"first": False, "tier": False, "parked": False, "replayed": False}
    for frame in frames:
        fields = split(frame.headers) if frame.headers else []
        ours = {name for name, _ in fields}
        stages["first"] |= not ours & {b"retry-count", b"replay-count"}
        stages["tier"] |= b"retry-count" in ours and b"parked-reason" not in ours
        stages["parked"] |= b"parked-reason" in ours
        stages["replayed"] |= b"replay-count" in ours
        assert sorted(f for f in fields if f[0] in names) == sorted(sent_fields), (
            message_id, fields)
    assert all(stages.values()), (message_id, stages)


@contextmanager
def own_vhost(vhost_factory: Callable[[], Settings], management: Management) -> Iterator[Settings]:
    settings = vhost_factory()
    try:
        yield settings
    finally:
        delete_vhost(management, settings.vhost)


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(tables(), min_size=12, max_size=12))
def test_generated_tables_come_back_byte_for_byte(
    batch: list[bytes], vhost_factory: Callable[[], Settings], management: Management,
    run_cli: Callable[..., Any],
) -> None:
    ids = [f"gen-{i}" for i in range(len(batch))]
    with own_vhost(vhost_factory, management) as vhost:

        def publish() -> None:
            blocking(publish_raw(vhost, [
                (f"body {i}".encode(), RawHeaders(headers=raw, message_id=ids[i], delivery_mode=2))
                for i, raw in enumerate(batch)
            ], exchange="orders", routing_key="order.created"))

        seen, replayed = through_the_product(vhost, run_cli, publish, len(batch))
    for message_id, raw in zip(ids, batch, strict=True):
        assert_kept(seen, message_id, raw)
    assert sorted(m.body for m in replayed) == sorted(f"body {i}".encode() for i in range(12))


# --- pika --------------------------------------------------------------------------------------

BODY = bytes(range(256)) + "é✓".encode()  # every byte value, and not UTF-8 as a whole


class Field(bytes):
    """A field value given as its bytes (type octet + payload), for the types pika cannot write."""


@contextmanager
def pika_writes_every_type() -> Iterator[None]:
    """pika's codec, taught to write a ``Field`` as it is (nested ones too)."""
    import pika.data

    real = pika.data.encode_value

    def encode_value(pieces: list[bytes], value: Any) -> int:
        if isinstance(value, Field):
            pieces.append(bytes(value))
            return len(value)
        return int(real(pieces, value))

    pika.data.encode_value = encode_value
    try:
        yield
    finally:
        pika.data.encode_value = real


PIKA_HEADERS: dict[str, Any] = {
    # What pika writes itself: every int as I (l when large), str S, bytes x, and so on.
    "int": 5, "large": 2**40, "negative": -7, "text": "héllo", "raw": b"\xff\x00",
    "flag": True, "none": None, "decimal": Decimal("12.50"), "list": [1, "two", [3]],
    "table": {"n": 5, "inner": {"t": False}},
    # The rest of the types, as bytes.
    "int8": Field(b"b\xfb"), "uint8": Field(b"B\xc8"), "int16": Field(b"s\x00\x05"),
    "uint16": Field(b"u\xfd\xe8"), "uint32": Field(b"i\xee\x6b\x28\x00"),
    "int64": Field(b"l" + struct.pack(">q", 42)), "float": Field(b"f" + struct.pack(">f", 0.5)),
    "double": Field(b"d" + struct.pack(">d", 0.1)),
    "timestamp": Field(b"T" + struct.pack(">Q", 1_700_000_000)),
    "nested": {"float": Field(b"f" + struct.pack(">f", 1.5)), "list": [Field(b"u\x00\x07")]},
}


def test_pika_headers_of_every_type_come_back_byte_for_byte(
    fresh_vhost: Settings, run_cli: Callable[..., Any],
) -> None:
    import pika
    import pika.data

    count = 3
    with pika_writes_every_type():
        pieces: list[bytes] = []
        pika.data.encode_table(pieces, PIKA_HEADERS)
        sent = b"".join(pieces)

        def publish() -> None:
            connection = pika.BlockingConnection(pika.URLParameters(fresh_vhost.url))
            try:
                channel = connection.channel()
                channel.confirm_delivery()
                for i in range(count):
                    channel.basic_publish(
                        "orders", "order.created", BODY,
                        pika.BasicProperties(headers=PIKA_HEADERS, message_id=f"pika-{i}",
                                             delivery_mode=2),
                        mandatory=True,
                    )
            finally:
                connection.close()

        seen, replayed = through_the_product(fresh_vhost, run_cli, publish, count)
    for i in range(count):
        assert_kept(seen, f"pika-{i}", sent)
    assert [m.body for m in replayed] == [BODY] * count
    # An int pika writes as I is the type the issue saw lost: still an I after all of it.
    assert dict(split(sent))[b"int"] == b"I\x00\x00\x00\x05"


# --- amqplib (Node) ----------------------------------------------------------------------------


def _amqplib() -> str:
    node = require("node", installed_by="Debian's nodejs package")
    if not (NODE_MODULES / "amqplib" / "package.json").is_file():
        reason = (f"amqplib is not installed in {NODE_MODULES} (npm install --prefix "
                  f"{NODE_MODULES.parent} amqplib; scripts/test.sh does it)")
        if in_ci():
            pytest.fail(f"{reason}; CI=true, so this fails instead of skipping")
        pytest.skip(reason)
    return node


def test_amqplib_headers_of_every_type_come_back_byte_for_byte(
    fresh_vhost: Settings, run_cli: Callable[..., Any],
) -> None:
    node = _amqplib()
    count = 3
    sent: list[bytes] = []

    def publish() -> None:
        for i in range(count):
            done = subprocess.run(
                [node, str(AMQPLIB_PUBLISH), fresh_vhost.url, "orders", "order.created",
                 f"node-{i}", BODY.hex()],
                capture_output=True, text=True, timeout=60, check=False,
                env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
            )
            assert done.returncode == 0, done.stderr
            sent.append(bytes.fromhex(done.stdout.strip()))

    seen, replayed = through_the_product(fresh_vhost, run_cli, publish, count)
    for i in range(count):
        assert_kept(seen, f"node-{i}", sent[i])
    assert [m.body for m in replayed] == [BODY] * count
    kinds = {name.decode(): value[:1].decode() for name, value in split(sent[0])}
    assert kinds == json.loads(
        '{"int8": "b", "uint8": "B", "int16": "s", "uint16": "u", "int32": "I", "uint32": "i",'
        ' "int64": "l", "float": "f", "double": "d", "decimal": "D", "timestamp": "T",'
        ' "string": "S", "bytes": "x", "bool": "t", "void": "V", "number": "b", "big": "l",'
        ' "fraction": "d", "array": "A", "table": "F"}'
    )
