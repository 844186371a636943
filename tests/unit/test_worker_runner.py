"""The runner's broker-free parts: handler timeouts, consumer checks, lazy payloads."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel

from rabbit_retry.errors import InputError
from rabbit_retry.topology import parse_topology
from rabbit_retry.worker import Delivery, InvalidPayload, Permanent, RetryConsumer
from rabbit_retry.worker.consumer import HandlerTimeout, check_consumer, is_blocking, payload_error
from rabbit_retry.worker.decide import Outcome
from rabbit_retry.worker.metrics import Metrics
from rabbit_retry.worker.runner import Runner, subscribe
from rabbit_retry.worker.session import Session, Subscription

TOPOLOGY = parse_topology(
    """\
version: 1
queues:
  q: {retry: {delays: [1s], max_attempts: 3}}
""",
    "t.yml",
)


def delivery(body: bytes = b"{}") -> Delivery:
    return Delivery(
        body=body,
        headers={},
        message_id="m",
        correlation_id=None,
        routing_key="k",
        exchange="e",
        queue="q",
        attempt=1,
        max_attempts=3,
    )


def subscription(consumer: RetryConsumer) -> Subscription:
    return subscribe([consumer], TOPOLOGY, Metrics())[0]


class Sleeper(RetryConsumer):
    queue = "q"

    def __init__(self, seconds: float, swallow: bool = False) -> None:
        self.seconds = seconds
        self.swallow = swallow

    async def handle(self, delivery: Delivery) -> None:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            if not self.swallow:
                raise


def test_lazy_payload_decodes_json_once_and_flags_a_body_that_is_not_json() -> None:
    ok = delivery(b'{"a": [1, 2]}')
    assert ok.payload == {"a": [1, 2]}
    assert ok.payload is ok.payload
    bad = delivery(b"\xff not json")
    with pytest.raises(InvalidPayload, match="body is not JSON"):
        bad.payload  # noqa: B018
    assert isinstance(payload_error(bad), InvalidPayload)
    assert "body=" not in repr(bad)


class Order(BaseModel):
    id: int


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"queue": ""}, "Bad.queue: set it to the name of a queue in the topology file"),
        ({"prefetch": 0}, "Bad.prefetch: expected an integer from 1 to 65535, got 0"),
        ({"prefetch": True}, "Bad.prefetch: expected an integer from 1 to 65535, got True"),
        (
            {"handler_timeout": -1},
            "Bad.handler_timeout: expected a positive number of seconds or None, got -1",
        ),
        (
            {"permanent_errors": KeyError},
            "Bad.permanent_errors: expected a tuple of exception classes, got <class 'KeyError'>",
        ),
        ({"permanent_errors": (KeyError, "x")}, "Bad.permanent_errors: expected a tuple of"),
    ],
)
def test_misconfigured_consumers_are_refused_in_one_line(
    attributes: dict[str, Any], message: str
) -> None:
    bad = type("Bad", (Sleeper,), attributes)(0)
    with pytest.raises(InputError) as caught:
        check_consumer(bad)
    assert str(caught.value).startswith(message)


def test_a_consumer_without_handle_is_refused() -> None:
    class NoHandle(RetryConsumer):
        queue = "q"

    with pytest.raises(InputError, match=r"NoHandle: define async def handle\(self, delivery\)"):
        check_consumer(NoHandle())


def test_model_gets_a_type_adapter() -> None:
    class Typed(Sleeper):
        model = Order

    adapter = check_consumer(Typed(0))
    assert adapter is not None
    assert adapter.validate_json(b'{"id": 3}') == Order(id=3)
    assert check_consumer(Sleeper(0)) is None


def test_subscribe_names_the_queues_of_the_file() -> None:
    class Elsewhere(Sleeper):
        queue = "nope"

    with pytest.raises(InputError) as caught:
        subscribe([Elsewhere(0)], TOPOLOGY, Metrics())
    assert str(caught.value) == "Elsewhere.queue = 'nope' is not a queue in t.yml (it has: q)"
    with pytest.raises(InputError, match="no consumer to run"):
        subscribe([], TOPOLOGY, Metrics())


def test_consumers_of_one_queue_share_its_metrics() -> None:
    metrics = Metrics()
    first, second = subscribe([Sleeper(0), Sleeper(0)], TOPOLOGY, metrics)
    assert first.metrics is second.metrics
    first.metrics.in_flight = 3
    assert metrics.registry.get_sample_value("rabbit_retry_in_flight", {"queue": "q"}) == 3


def test_permanent_is_an_exception_users_can_raise() -> None:
    assert issubclass(Permanent, Exception)


class Blocking(RetryConsumer):
    queue = "q"
    prefetch = 2

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.threads: list[str] = []

    def handle(self, delivery: Delivery) -> None:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)


async def test_a_blocking_handle_runs_in_a_thread_pool_of_prefetch_threads() -> None:
    consumer = Blocking(0)
    sub = subscription(consumer)
    assert is_blocking(consumer) and not is_blocking(Sleeper(0))
    assert sub.threads is not None and sub.threads._max_workers == 2

    async def run_one() -> object:
        task = asyncio.current_task()
        assert task is not None
        return await Session._run(sub, task, delivery())

    assert await asyncio.gather(*(run_one() for _ in range(4))) == [Outcome.SUCCESS] * 4
    assert consumer.threads and all(t.startswith("rabbit-retry-Blocking") for t in consumer.threads)
    sub.threads.shutdown()


async def test_a_blocking_handle_times_out_too() -> None:
    consumer = Blocking(0.5)
    consumer.handler_timeout = 0.05
    sub = subscription(consumer)
    task = asyncio.current_task()
    assert task is not None
    what = await Session._run(sub, task, delivery())
    assert isinstance(what, HandlerTimeout)
    assert str(what) == "the handler did not finish within 0.05s"
    assert sub.threads is not None
    sub.threads.shutdown()


def test_a_generator_handle_is_refused() -> None:
    class Gen(RetryConsumer):
        queue = "q"

        async def handle(self, delivery: Delivery) -> None:  # type: ignore[override]
            yield None

    with pytest.raises(InputError, match=r"Gen.handle: a generator"):
        check_consumer(Gen())


def test_healthz_fails_once_the_event_loop_stops_turning() -> None:
    runner = Runner.__new__(Runner)
    runner._beat = time.monotonic()
    assert runner._live() == (True, "alive")
    runner._beat = time.monotonic() - 45
    ok, why = runner._live()
    assert not ok and why.startswith("the event loop has not run for 4")
