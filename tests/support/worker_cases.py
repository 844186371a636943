"""Worker decision cases written once and run twice (test-only): on ``rabbit_retry.testing``'s
in-memory broker (tests/unit/test_worker_cases_in_memory.py, every version, milliseconds each)
and on the real broker under test (tests/integration/test_worker_cases_on_rabbitmq.py), which
proves the in-memory broker faithful on what the worker's decisions depend on.

A case sees the broker through an ``Env``: publish with exact wire properties, run consumers,
wait until a condition holds (on the real broker by polling; in memory by running every retry to
its end first), take what waits in a queue. FastStream's ``tests/brokers/base`` is the model.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import pytest
from aiormq import spec
from pydantic import BaseModel

from rabbit_retry.contract import copy_properties
from rabbit_retry.settings import Settings
from rabbit_retry.testing import TestBroker
from rabbit_retry.topology import Topology, parse_topology
from rabbit_retry.worker import Delivery, Permanent, RetryConsumer

from .amqp import Taken, depth, drain, publish_raw
from .poll import eventually
from .provision import provision
from .worker import running

Q = "orders.fraud-check"
PARKING = Q + ".parking"
Check = Callable[[], bool | Awaitable[bool]]


def orders_yaml(*, queue_type: str = "quorum", delays: str = "[300ms, 600ms]",
                attempts: int = 4, sibling: bool = False) -> str:
    """``Q`` bound to topic exchange ``orders``; with ``sibling``, a classic queue beside it
    that takes ``order.*`` too."""
    text = f"""\
version: 1
exchanges:
  orders: {{type: topic}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: orders, routing_key: order.created}}]
    retry: {{delays: {delays}, max_attempts: {attempts}}}
"""
    if sibling:
        text += """\
  orders.audit:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
"""
    return text


class Env(Protocol):
    """A broker for a case to run on."""

    version: str  # "3.10", "4.0" or "4.3"

    def running(self, yaml: str, *consumers: RetryConsumer[Any]) -> (
            contextlib.AbstractAsyncContextManager[None]): ...

    async def publish(self, body: bytes, properties: spec.Basic.Properties, *,
                      exchange: str = "", routing_key: str = Q) -> None: ...

    async def until(self, check: Check, what: str) -> None: ...

    async def take(self, queue: str) -> list[Taken]: ...

    async def depth(self, queue: str) -> int: ...


async def _holds(check: Check) -> bool:
    result = check()
    return bool(await result) if inspect.isawaitable(result) else bool(result)


class InMemory:
    """``Env`` on ``rabbit_retry.testing.TestBroker``."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.broker: TestBroker | None = None

    @contextlib.asynccontextmanager
    async def running(self, yaml: str, *consumers: RetryConsumer[Any]) -> AsyncIterator[None]:
        async with TestBroker(parse_topology(yaml, "worker-case.yml"),
                              version=self.version) as broker, broker.worker(*consumers):
            self.broker = broker
            yield
            assert broker.discarded == []  # nothing lost on the way

    def _broker(self) -> TestBroker:
        assert self.broker is not None, "publish inside running()"
        return self.broker

    async def publish(self, body: bytes, properties: spec.Basic.Properties, *,
                      exchange: str = "", routing_key: str = Q) -> None:
        self._broker().publish(body, exchange=exchange, routing_key=routing_key,
                               properties=properties)

    async def until(self, check: Check, what: str) -> None:
        await self._broker().settle(retries=True)
        assert await _holds(check), f"{what}: not so once every retry ran"

    async def take(self, queue: str) -> list[Taken]:
        broker = self._broker()
        taken = [Taken(m.body, m.properties, m.redelivered) for m in broker.messages(queue)]
        broker.memory.purge(queue)
        return taken

    async def depth(self, queue: str) -> int:
        return len(self._broker().messages(queue))


class OnRabbitMQ:
    """``Env`` on the real broker, in a vhost of the test's own."""

    def __init__(self, settings: Settings, version: str) -> None:
        self.settings = settings
        self.version = version

    @contextlib.asynccontextmanager
    async def running(self, yaml: str, *consumers: RetryConsumer[Any]) -> AsyncIterator[None]:
        topology: Topology = parse_topology(yaml, "worker-case.yml")
        await provision(self.settings, topology)
        async with running(list(consumers), topology, self.settings):
            yield

    async def publish(self, body: bytes, properties: spec.Basic.Properties, *,
                      exchange: str = "", routing_key: str = Q) -> None:
        await publish_raw(self.settings, [(body, properties)], routing_key=routing_key,
                          exchange=exchange)

    async def until(self, check: Check, what: str) -> None:
        await eventually(lambda: _holds(check), what=what)

    async def take(self, queue: str) -> list[Taken]:
        return await drain(self.settings, queue)

    async def depth(self, queue: str) -> int:
        return await depth(self.settings, queue) or 0


class Recorder(RetryConsumer):
    """Records every call; ``behaviour(delivery)`` decides what each attempt does."""

    queue = Q
    prefetch = 20
    handler_timeout = 10.0

    def __init__(self, behaviour: Callable[[Delivery], Any] | None = None) -> None:
        self.calls: list[Delivery] = []
        self.behaviour = behaviour

    async def handle(self, delivery: Delivery) -> None:
        self.calls.append(delivery)
        if self.behaviour is not None:
            self.behaviour(delivery)


def fail_until(success_attempt: int) -> Callable[[Delivery], None]:
    def behaviour(delivery: Delivery) -> None:
        if delivery.attempt < success_attempt:
            raise RuntimeError(f"boom {delivery.attempt}")

    return behaviour


def props(message_id: str, headers: dict[str, Any] | None = None,
          **fields: Any) -> spec.Basic.Properties:
    """Persistent properties with exactly these headers (encoded as the worker encodes)."""
    return copy_properties(spec.Basic.Properties(message_id=message_id, delivery_mode=2,
                                                 **fields), headers or {})


class Order(BaseModel):
    id: int
    total: float


class Declined(Exception):
    pass


# Every AMQP field type a header can carry, as the worker's encoder writes them.
USER_HEADERS: dict[str, Any] = {
    "tenant": "acme",
    "double": 0.1,
    "big": 2**40,
    "negative": -7,
    "flag": True,
    "nothing": None,
    "binary": b"\xff\x00\xfe",
    "price": decimal.Decimal("12.50"),
    "when": datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC),
    "nested": {"list": [1, "two", {"three": 3.5}], "empty": {}},
    "unicode": "grüße ✓",
}


def deaths(headers: dict[str, Any]) -> list[tuple[str, str, int]]:
    return sorted((d["queue"], d["reason"], d["count"]) for d in headers.get("x-death", []))


class WorkerCases:
    """The cases; a subclass provides the ``env`` fixture."""

    async def test_success_acks_with_where_the_message_was_published(self, env: Env) -> None:
        consumer = Recorder()
        async with env.running(orders_yaml(), consumer):
            for i in range(5):
                await env.publish(b'{"id": %d}' % i, props(f"m-{i}"), exchange="orders",
                                  routing_key="order.created")
            await env.until(lambda: len(consumer.calls) == 5, "five handler calls")
            await env.until(lambda: _all_empty(env, Q), "acked")
        assert sorted(d.message_id or "" for d in consumer.calls) == [f"m-{i}" for i in range(5)]
        first = consumer.calls[0]
        assert (first.attempt, first.max_attempts) == (1, 4)
        assert (first.exchange, first.routing_key, first.queue) == ("orders", "order.created", Q)
        assert first.payload == {"id": int(first.message_id.removeprefix("m-"))}  # type: ignore[union-attr]

    async def test_one_delay_on_quorum_is_the_brokers_nack_cycle_where_it_leaves_counts_clean(
        self, env: Env
    ) -> None:
        consumer = Recorder(fail_until(2))
        async with env.running(orders_yaml(delays="[300ms]", attempts=3), consumer):
            await env.publish(b"{}", props("n-1"), exchange="orders",
                              routing_key="order.created")
            await env.until(lambda: len(consumer.calls) == 2, "second attempt")
            await env.until(lambda: _all_empty(env, Q, f"{Q}.retry.300ms", PARKING), "acked")
        first, second = consumer.calls
        assert (first.attempt, second.attempt) == (1, 2)
        assert (second.exchange, second.routing_key) == ("orders", "order.created")
        headers = dict(second.headers)
        if env.version == "4.0":  # the broker's cycle adds a return there: a copy instead
            assert headers["retry-count"] == 1
            assert deaths(headers) == [(f"{Q}.retry.300ms", "expired", 1)]
            return
        assert "retry-count" not in headers
        assert deaths(headers) == [(Q, "rejected", 1), (f"{Q}.retry.300ms", "expired", 1)]
        [rejected] = [d for d in headers["x-death"] if d["reason"] == "rejected"]
        assert (rejected["exchange"], rejected["routing-keys"]) == ("orders", ["order.created"])
        assert "x-delivery-count" not in headers and not second.headers.get("x-acquired-count")

    async def test_one_delay_on_classic_is_a_confirmed_copy(self, env: Env) -> None:
        consumer = Recorder(fail_until(2))
        async with env.running(orders_yaml(queue_type="classic", delays="[300ms]",
                                           attempts=3), consumer):
            await env.publish(b"{}", props("c-1"), exchange="orders",
                              routing_key="order.created")
            await env.until(lambda: len(consumer.calls) == 2, "second attempt")
            await env.until(lambda: _all_empty(env, Q), "acked")
        headers = dict(consumer.calls[1].headers)
        assert headers["retry-count"] == 1
        assert (headers["original-exchange"], headers["original-routing-key"]) == (
            "orders", "order.created")
        assert deaths(headers) == [(f"{Q}.retry.300ms", "expired", 1)]

    @pytest.mark.parametrize("queue_type", ["quorum", "classic"])
    async def test_several_delays_walk_the_tiers_then_park_exhausted(
        self, env: Env, queue_type: str
    ) -> None:
        consumer = Recorder(fail_until(99))
        async with env.running(orders_yaml(queue_type=queue_type), consumer):
            await env.publish(b'{"order": 7}', props("s-1", correlation_id="corr-7"),
                              exchange="orders", routing_key="order.created")
            await env.until(lambda: _depth_is(env, PARKING, 1), "parked")
            [parked] = await env.take(PARKING)
            await env.until(lambda: _all_empty(env, Q, f"{Q}.retry.300ms", f"{Q}.retry.600ms"),
                            "nothing left")
        assert [d.attempt for d in consumer.calls] == [1, 2, 3, 4]
        assert [d.headers.get("retry-count") for d in consumer.calls] == [None, 1, 2, 3]
        headers = parked.headers
        assert headers["parked-reason"] == "exhausted"
        assert headers["retry-count"] == 4
        assert (headers["exception-type"], headers["exception-message"]) == (
            "RuntimeError", "boom 4")
        assert "RuntimeError: boom 4" in headers["exception-stacktrace"]
        assert (headers["original-exchange"], headers["original-routing-key"],
                headers["original-queue"]) == ("orders", "order.created", Q)
        assert deaths(headers) == [(f"{Q}.retry.600ms", "expired", 1)]  # kept as history
        assert (parked.body, parked.correlation_id) == (b'{"order": 7}', "corr-7")

    async def test_permanent_failures_park_at_once(self, env: Env) -> None:
        def behaviour(delivery: Delivery) -> None:
            if delivery.message_id == "p-1":
                raise Permanent("card declined")
            raise Declined("card declined")

        class Strict(Recorder):
            permanent_errors = (Declined,)

        consumer = Strict(behaviour)
        async with env.running(orders_yaml(), consumer):
            for message_id in ("p-1", "p-2"):
                await env.publish(b"{}", props(message_id))
            await env.until(lambda: _depth_is(env, PARKING, 2), "both parked")
            await env.until(lambda: _all_empty(env, Q), "acked")
            parked = {m.message_id: m.headers for m in await env.take(PARKING)}
        assert len(consumer.calls) == 2
        assert {h["parked-reason"] for h in parked.values()} == {"permanent"}
        assert {h["retry-count"] for h in parked.values()} == {1}
        assert parked["p-1"]["exception-type"] == "rabbit_retry.worker.consumer.Permanent"
        assert parked["p-2"]["exception-type"] == f"{__name__}.Declined"

    async def test_a_body_failing_the_model_parks_invalid_without_a_handler_call(
        self, env: Env
    ) -> None:
        class Typed(Recorder):
            model = Order

        consumer = Typed()
        async with env.running(orders_yaml(), consumer):
            await env.publish(b'{"id": 1}', props("missing-total"))
            await env.publish(b"not json", props("not-json"))
            await env.publish(b'{"id": 2, "total": 9.5}', props("ok"))
            await env.until(lambda: _depth_is(env, PARKING, 2), "two parked")
            await env.until(lambda: len(consumer.calls) == 1, "the valid one handled")
            parked = {m.message_id: m for m in await env.take(PARKING)}
        assert [d.payload for d in consumer.calls] == [Order(id=2, total=9.5)]
        assert {m.headers["parked-reason"] for m in parked.values()} == {"invalid"}
        assert {m.headers["retry-count"] for m in parked.values()} == {0}
        assert parked["not-json"].body == b"not json"

    async def test_a_garbled_x_death_takes_the_copy_path(self, env: Env) -> None:
        consumer = Recorder(fail_until(2))
        garbled = {"x-death": ["junk", 7, {"queue": Q, "reason": "rejected", "count": "x"}]}
        async with env.running(orders_yaml(delays="[300ms]", attempts=3), consumer):
            await env.publish(b"{}", props("g-1", garbled))
            await env.until(lambda: len(consumer.calls) == 2, "second attempt")
            await env.until(lambda: _all_empty(env, Q), "acked")
        first, second = consumer.calls
        assert (first.attempt, second.attempt) == (1, 2)  # the garbled count counts as 0
        assert second.headers["retry-count"] == 1
        assert deaths(dict(second.headers)) == [(f"{Q}.retry.300ms", "expired", 1)]

    async def test_headers_and_properties_reach_parking_exactly(self, env: Env) -> None:
        consumer = Recorder(fail_until(99))
        expiring = props("f-1", USER_HEADERS, expiration="600000", content_type="text/plain",
                         app_id="shop", priority=3)
        # Classic: every retry is the worker's copy (the broker's own nack cycle would note the
        # expiration in x-death instead).
        async with env.running(orders_yaml(queue_type="classic", delays="[300ms]", attempts=2),
                               consumer):
            await env.publish(b"exact", expiring)
            await env.until(lambda: _depth_is(env, PARKING, 1), "parked")
            [parked] = await env.take(PARKING)
        assert [d.attempt for d in consumer.calls] == [1, 2]
        retried = dict(consumer.calls[1].headers)
        for headers in (retried, parked.headers):
            assert {k: headers[k] for k in USER_HEADERS} == USER_HEADERS
            assert headers["original-expiration"] == "600000"
        assert parked.properties.expiration is None
        assert (parked.body, parked.content_type, parked.app_id, parked.priority) == (
            b"exact", "text/plain", "shop", 3)


async def _all_empty(env: Env, *queues: str) -> bool:
    for queue in queues:
        if await env.depth(queue) != 0:
            return False
    return True


async def _depth_is(env: Env, queue: str, expected: int) -> bool:
    return await env.depth(queue) == expected

