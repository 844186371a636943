"""The worker's decisions read off the in-memory broker (``rabbit_retry.testing``): what a
user's test sees, and the paths that need a broker's cooperation (timeouts, pauses, duplicates,
crash loops, reconnects, failed publishes) without one. Milliseconds each."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.worker_cases import Q, orders_yaml

from rabbit_retry import Delivery, Idempotency, Pause, Permanent, RetryConsumer
from rabbit_retry.testing import SettleTimeout, SyncTestBroker, TestBroker, Verdict
from rabbit_retry.topology import parse_topology
from rabbit_retry.worker.copies import DELIVERY_LIMIT_REACHED

PARKING = Q + ".parking"
VERSIONS = ("3.10", "4.0", "4.3")


def broker_for(yaml: str, version: str = "4.3") -> TestBroker:
    return TestBroker(parse_topology(yaml, "in-memory.yml"), version=version)


class Scripted(RetryConsumer):
    """Does what ``script[message_id]`` says on each attempt: "ok", "fail", "permanent"."""

    queue = Q
    prefetch = 10

    def __init__(self, script: dict[str, list[str]] | None = None, otherwise: str = "ok") -> None:
        self.script = script or {}
        self.otherwise = otherwise
        self.calls: list[tuple[str | None, int]] = []

    async def handle(self, delivery: Delivery) -> None:
        self.calls.append((delivery.message_id, delivery.attempt))
        steps = self.script.get(delivery.message_id or "", [self.otherwise])
        step = steps[min(delivery.attempt, len(steps)) - 1]
        if step == "fail":
            raise RuntimeError(f"{delivery.message_id} failed at attempt {delivery.attempt}")
        if step == "permanent":
            raise Permanent("no such customer")


# --- decisions, as a user's test reads them ----------------------------------------------------


async def test_each_path_is_one_decision_with_its_destination_and_headers() -> None:
    consumer = Scripted({"flaky": ["fail", "ok"], "ghost": ["permanent"]})
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        for message_id in ("fine", "flaky", "ghost"):
            broker.publish(json={"id": message_id}, exchange="orders",
                           routing_key="order.created", message_id=message_id)
        decisions = {d.message_id: d for d in await broker.settle()}
        assert decisions["fine"].verdict == Verdict.ACKED
        assert (decisions["fine"].to, decisions["fine"].headers) == (None, {})
        flaky = decisions["flaky"]
        assert (flaky.verdict, flaky.tier) == ("retried", f"{Q}.retry.300ms")
        assert flaky.headers == {"retry-count": 1, "original-exchange": "orders",
                                 "original-routing-key": "order.created",
                                 "exception-type": "RuntimeError",
                                 "exception-message": "flaky failed at attempt 1"}
        ghost = decisions["ghost"]
        assert (ghost.verdict, ghost.to, ghost.reason) == ("parked", PARKING, "permanent")
        assert ghost.headers["exception-message"] == "no such customer"
        assert ghost.message.json() == {"id": "ghost"}
        assert [str(d) for d in await broker.settle(retries=True)] == [
            f"acked flaky from {Q}"]
        assert [m.message_id for m in broker.parked(Q)] == ["ghost"]
    assert Counter(c for c, _ in consumer.calls) == {"fine": 1, "flaky": 2, "ghost": 1}


@pytest.mark.parametrize("version", VERSIONS)
async def test_one_delay_on_quorum_that_parks_its_dead_letters_retries_through_a_copy(
    version: str,
) -> None:
    # on_expire: park routes what Q dead-letters to Q.parking: a nack would park the message.
    yaml = orders_yaml(delays="[5s]", attempts=3) + (
        "    policy: {message_ttl: 1d}\n    on_expire: park\n")
    consumer = Scripted({"n": ["fail", "ok"]})
    async with broker_for(yaml, version) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="n")
        [decision] = await broker.settle()
        assert (decision.verdict, decision.tier) == ("retried", f"{Q}.retry.5s")
        assert decision.copy is not None and decision.copy.routing_key == "5s"
        assert [str(d) for d in await broker.settle(retries=True)] == [f"acked n from {Q}"]
        assert broker.parked(Q) == []


@pytest.mark.parametrize("version", VERSIONS)
async def test_one_delay_on_quorum_is_decided_per_version(version: str) -> None:
    consumer = Scripted({"n": ["fail", "ok"]})
    async with broker_for(orders_yaml(delays="[5s]", attempts=3), version) as broker, \
            broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="n")
        [decision] = await broker.settle()
        assert (decision.verdict, decision.tier) == ("retried", f"{Q}.retry.5s")
        if version == "4.0":  # the broker's cycle would count a return there: a copy
            assert decision.copy is not None and decision.copy.routing_key == "5s"
            assert decision.headers["retry-count"] == 1
        else:  # the broker's own nack cycle: what the tier holds is the dead-lettered message
            assert "retry-count" not in decision.headers
            [death] = decision.headers["x-death"]
            assert (death["queue"], death["reason"]) == (Q, "rejected")
        assert await broker.advance(4.999) == []
        [acked] = await broker.advance(0.001)
        assert acked.verdict == "acked"
        assert not acked.message.redelivered  # every path leaves it a fresh message
    assert consumer.calls == [("n", 1), ("n", 2)]


async def test_a_message_without_an_id_is_still_matched_to_its_copy() -> None:
    consumer = Scripted(otherwise="fail")
    async with broker_for(orders_yaml(queue_type="classic")) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q)
        [retried] = await broker.settle()
        assert retried.message_id is None
        assert retried.copy is not None and retried.copy.message_id  # the worker gave it one
        decisions = await broker.settle(retries=True)
    assert [d.verdict for d in decisions] == ["retried", "retried", "parked"]


async def test_a_handler_past_its_timeout_is_retried_then_parked_with_the_timeout() -> None:
    class Slow(RetryConsumer):
        queue = Q
        handler_timeout = 0.02

        async def handle(self, delivery: Delivery) -> None:
            await asyncio.Event().wait()

    async with broker_for(orders_yaml(delays="[1m]", attempts=2)) as broker, \
            broker.worker(Slow()):
        broker.publish(b"{}", queue=Q, message_id="t")
        [retried] = await broker.settle()
        [parked] = await broker.settle(retries=True)
    assert retried.verdict == "retried"
    assert parked.reason == "exhausted"
    assert parked.headers["exception-type"] == "rabbit_retry.worker.consumer.HandlerTimeout"
    assert parked.headers["exception-message"] == "the handler did not finish within 0.02s"


async def test_a_message_arriving_exhausted_parks_before_the_handler() -> None:
    consumer = Scripted()
    async with broker_for(orders_yaml(attempts=3)) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="late", headers={"retry-count": 5})
        [parked] = await broker.settle()
    assert (parked.reason, parked.headers["retry-count"]) == ("exhausted", 5)
    assert parked.headers["exception-type"] == "rabbit_retry.worker.ExhaustedOnArrival"
    assert consumer.calls == []


async def test_a_foreign_user_id_moves_to_a_header_so_the_broker_takes_the_copy() -> None:
    """The broker refuses a publish whose user_id is not the connection's user: a copy that
    kept it could never be confirmed (the test broker refuses it as RabbitMQ does)."""
    consumer = Scripted({"u": ["permanent"]})
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="u", user_id="someone-else")
        [parked] = await broker.settle(within=2)
    assert parked.copy is not None and parked.copy.properties.user_id is None
    assert parked.headers["original-user-id"] == "someone-else"


async def test_a_huge_exception_message_still_parks_within_the_frame_size() -> None:
    class Loud(RetryConsumer):
        queue = Q

        async def handle(self, delivery: Delivery) -> None:
            raise Permanent("x" * 1_000_000)

    async with broker_for(orders_yaml()) as broker, broker.worker(Loud()):
        broker.publish(b"{}", queue=Q, message_id="loud", headers={"big": "y" * 100_000})
        [parked] = await broker.settle()
    assert parked.reason == "permanent"
    assert len(parked.headers["exception-message"]) < 2048
    assert parked.headers["big"] == "y" * 100_000


# --- what needs the broker's cooperation ---------------------------------------------------------


class GatewayDown(ConnectionError):
    pass


class Charge(RetryConsumer):
    queue = Q
    prefetch = 1
    pause = Pause(after=3, on=(GatewayDown,), probe_every=0.01)

    def __init__(self) -> None:
        self.up = False
        self.calls: list[tuple[str | None, int]] = []

    async def handle(self, delivery: Delivery) -> None:
        self.calls.append((delivery.message_id, delivery.attempt))
        if not self.up:
            raise GatewayDown("payment gateway unreachable")


async def test_a_pause_stops_the_queue_after_its_trip_and_a_probe_resumes_it() -> None:
    consumer = Charge()
    async with broker_for(orders_yaml(delays="[1s]", attempts=3)) as broker, \
            broker.worker(consumer) as worker:
        for i in range(6):
            broker.publish(b"{}", queue=Q, message_id=f"c-{i}")
        # The trip (charged, retried), then probes while the gateway is still down, each sent
        # back unchanged. The probes keep real time (every 0.01 s): on a loaded machine the
        # first may come before the trip's settle returns.
        decisions = await broker.settle()
        while "sent-back" not in [d.verdict for d in decisions]:
            decisions += await broker.settle(expect=1)
        verdicts = [d.verdict for d in decisions]
        assert verdicts[:3] == ["retried"] * 3, verdicts
        assert set(verdicts[3:]) == {"sent-back"}, verdicts
        metrics = worker.runner.metrics.for_queue(Q)
        assert (metrics.paused, metrics.pauses) == (1, 1)
        assert len(broker.messages(Q)) == 3  # the rest wait, unconsumed (a probe's is back)
        consumer.up = True
        await broker.settle(expect=1)
        rest = await broker.settle(retries=True)
        assert metrics.paused == 0
    verdicts = Counter(d.verdict for d in broker.decisions)
    assert verdicts["parked"] == 0
    assert verdicts["acked"] == 6
    attempts = {message_id: attempt for message_id, attempt in consumer.calls}
    assert sorted(attempts.values()) == [1, 1, 1, 2, 2, 2]  # only the trip's three retried
    assert rest and all(d.verdict == "acked" for d in rest)


def _confirms_later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The worker's copies are confirmed ``seconds`` after they are published."""
    from rabbit_retry.worker.publisher import Publisher

    publish = Publisher.publish

    async def later(self: Publisher, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(seconds)
        return await publish(self, *args, **kwargs)

    monkeypatch.setattr(Publisher, "publish", later)


async def test_a_delivery_answered_while_a_pause_is_carried_out_resumes_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trip's failure waits for its copy's confirm before the lanes pause; a delivery that
    succeeds meanwhile resumes the breaker, and finds the lanes not paused yet. The pause then
    resumes at once. Before, the lanes stayed paused with no probe to resume them: the queue
    was never consumed again (only a reconnect did)."""
    _confirms_later(monkeypatch, 0.2)  # the confirm's round trip: the other one answers first

    class Racing(RetryConsumer):
        queue = Q
        prefetch = 2
        pause = Pause(after=1, on=(GatewayDown,), probe_every=3600)

        def __init__(self) -> None:
            self.failed = asyncio.Event()
            self.calls: list[str | None] = []

        async def handle(self, delivery: Delivery) -> None:
            self.calls.append(delivery.message_id)
            if delivery.message_id == "a":
                self.failed.set()
                raise GatewayDown("payment gateway unreachable")
            if delivery.message_id == "b":
                await self.failed.wait()

    consumer = Racing()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer) as worker:
        broker.publish(b"{}", queue=Q, message_id="a")
        broker.publish(b"{}", queue=Q, message_id="b")
        await broker.wait_for(lambda: worker.runner.metrics.for_queue(Q).pauses == 1,
                              what="the pause")
        broker.publish(b"{}", queue=Q, message_id="c")
        await broker.wait_for(lambda: "c" in consumer.calls, what="c handled")
        assert worker.runner.metrics.for_queue(Q).paused == 0


async def test_a_pause_during_a_change_of_consumer_leaves_no_consumer_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A returned delivery moves the lane to probation (cancel, consume again) and trips the
    pause while the new consume is on the wire (the broker registers a consumer before its
    ConsumeOk comes back). Before, the pause cut the consume short without knowing its tag: a
    consumer nobody knew of kept delivering to the paused lane, which sent each message back as
    a copy, over and over, until a probe resumed it."""
    from rabbit_retry.testing.amqp import Channel

    consume = Channel.basic_consume

    async def answered_later(self: Channel, *args: Any, **kwargs: Any) -> Any:
        answer = await consume(self, *args, **kwargs)  # registered at once
        await asyncio.sleep(0.03)  # the ConsumeOk, a round trip later
        return answer

    monkeypatch.setattr(Channel, "basic_consume", answered_later)
    _confirms_later(monkeypatch, 0.015)  # the failure's copy, while the consume is out

    class Tripping(RetryConsumer):
        queue = Q
        prefetch = 2
        pause = Pause(after=1, on=(GatewayDown,), probe_every=3600)

        def __init__(self) -> None:
            self.calls: list[str | None] = []

        async def handle(self, delivery: Delivery) -> None:
            self.calls.append(delivery.message_id)
            if delivery.message_id == "returned":
                raise GatewayDown("payment gateway unreachable")

    consumer = Tripping()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer) as worker:
        broker.publish(b"{}", queue=Q, message_id="first")  # the lane leaves probation
        await broker.wait_for(lambda: "first" in consumer.calls, what="first handled")
        await broker.settle()
        broker.publish(b"{}", queue=Q, message_id="returned", redelivered=True)
        metrics = worker.runner.metrics.for_queue(Q)
        await broker.wait_for(lambda: metrics.paused == 1, what="the pause")
        connection = worker.connection
        assert connection is not None
        await broker.wait_for(lambda: Q not in connection.consumed(),
                              what="no consumer left on the paused queue")
        broker.publish(b"{}", queue=Q, message_id="later")
        await broker.settle()
        assert [m.message_id for m in broker.messages(Q)] == ["later"]  # waits, unconsumed


async def test_a_graceful_stop_lets_a_probe_in_flight_finish_within_the_grace() -> None:
    """A stop while a pause's probe is being handled: it finishes (acked), as any delivery in
    flight does within the grace. Before, the stop cancelled it at once and its message went
    back unacked (on a quorum queue, a return counted toward the delivery limit)."""

    class Slow(RetryConsumer):
        queue = Q
        prefetch = 1
        pause = Pause(after=1, on=(GatewayDown,), probe_every=0.05)

        def __init__(self) -> None:
            self.started = asyncio.Event()
            self.finished: list[str | None] = []

        async def handle(self, delivery: Delivery) -> None:
            if delivery.message_id == "trip":
                raise GatewayDown("payment gateway unreachable")
            self.started.set()
            await asyncio.sleep(0.3)  # well within the grace
            self.finished.append(delivery.message_id)

    consumer = Slow()
    async with broker_for(orders_yaml()) as broker:
        async with broker.worker(consumer, grace=10.0) as worker:
            broker.publish(b"{}", queue=Q, message_id="trip")
            metrics = worker.runner.metrics.for_queue(Q)
            await broker.wait_for(lambda: metrics.paused == 1, what="the pause")
            broker.publish(b"{}", queue=Q, message_id="probe")  # the next probe takes it
            await asyncio.wait_for(consumer.started.wait(), 10)
            await worker.stop()
        assert consumer.finished == ["probe"]
        assert {d.message_id: d.verdict for d in broker.decisions}["probe"] == Verdict.ACKED


async def test_an_internal_error_twice_leaves_a_message_unacked_where_a_nack_would_drop_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug of the worker's while carrying out a failure, and again while charging it: the
    fallback nacks it into its retry tiers only where the queue's dead letters go there. With
    ``on_full: drop`` they go nowhere: the message stays unacked and goes back to the queue
    with the channel. Before, the nack dropped it."""
    from rabbit_retry.worker import copies

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a bug in the worker")

    monkeypatch.setattr(copies, "retry_headers", broken)
    yaml = f"""\
version: 1
queues:
  {Q}:
    queue_type: classic
    arguments: {{x-max-length: 10000}}
    on_full: drop
    retry: {{delays: [1s, 2s], max_attempts: 3}}
"""

    class Failing(RetryConsumer):
        queue = Q

        async def handle(self, delivery: Delivery) -> None:
            raise RuntimeError("transient")

    async with broker_for(yaml) as broker:
        broker.publish(b"{}", queue=Q, message_id="m")
        async with broker.worker(Failing()) as worker:
            metrics = worker.runner.metrics.for_queue(Q)
            await broker.wait_for(lambda: metrics.internal_errors == 1, what="the bug")
            await worker.stop()
        assert broker.discarded == []
        assert [m.message_id for m in broker.messages(Q)] == ["m"]


async def test_idempotency_acks_a_duplicate_without_calling_the_handler(tmp_path: Path) -> None:
    class Once(Scripted):
        idempotency = Idempotency(f"sqlite:///{tmp_path / 'dedupe.db'}", window=3600)

    consumer = Once()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="k")
        await broker.settle()
        broker.publish(b"{}", queue=Q, message_id="k")
        broker.publish(b"{}", queue=Q, message_id="other")
        decisions = await broker.settle()
    assert [d.verdict for d in decisions] == ["acked", "acked"]
    assert consumer.calls == [("k", 1), ("other", 1)]


class Hangs(RetryConsumer):
    """Its handler never returns: the test crashes the worker under it."""

    queue = Q
    prefetch = 5
    handler_timeout = None

    def __init__(self) -> None:
        self.hanging = False
        self.calls: list[int] = []

    async def handle(self, delivery: Delivery) -> None:
        self.calls.append(delivery.attempt)
        self.hanging = True
        await asyncio.Event().wait()


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_crash_loop_is_counted_before_the_delivery_limit_and_parked(version: str) -> None:
    """docs/versions.md: with ``x-delivery-limit: 2``, a message that kills its worker is
    handled twice per attempt, then counted as a failed attempt by the worker itself."""
    yaml = orders_yaml(attempts=2).replace(
        "    retry:", "    arguments: {x-delivery-limit: 2}\n    retry:")
    consumer = Hangs()
    seen: list[str] = []
    async with broker_for(yaml, version) as broker:
        broker.publish(b"{}", queue=Q, message_id="poison")
        for _ in range(8):
            before = len(broker.decisions)

            def happened(start: int = before) -> bool:
                return consumer.hanging or any(
                    d.verdict in ("retried", "parked") for d in broker.decisions[start:])

            async with broker.worker(consumer) as worker:
                await broker.wait_for(happened, what="a handler call or the worker's verdict")
                if consumer.hanging:
                    consumer.hanging = False
                    seen.append("crash")
                    await worker.crash()
                else:
                    seen.append(broker.decisions[-1].verdict)
            if seen[-1] == "parked":
                break
            await broker.advance(1)  # no worker: a retried copy comes back meanwhile
        [parked] = broker.parked(Q)
        assert broker.discarded == []
    assert seen == ["crash", "crash", "retried", "crash", "crash", "parked"]
    assert consumer.calls == [1, 1, 2, 2]
    assert parked.headers["exception-type"] == DELIVERY_LIMIT_REACHED
    assert parked.headers["retry-count"] == 2


async def test_a_returned_delivery_runs_alone() -> None:
    running: set[str] = set()
    beside: dict[str, set[str]] = {}

    class Watch(RetryConsumer):
        queue = Q
        prefetch = 10

        async def handle(self, delivery: Delivery) -> None:
            name = delivery.message_id or ""
            beside[name] = set(running)
            running.add(name)
            await asyncio.sleep(0.001)
            beside[name] |= running - {name}
            running.discard(name)

    async with broker_for(orders_yaml()) as broker:
        for i in range(4):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        broker.publish(b"{}", queue=Q, message_id="returned", redelivered=True)
        for i in range(4, 8):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        async with broker.worker(Watch()):
            decisions = await broker.settle()
    assert Counter(d.verdict for d in decisions) == {"acked": 9}
    assert beside["returned"] == set()
    assert any(beside[f"m-{i}"] for i in range(8))  # positive control: the others overlap


async def test_a_lost_connection_returns_the_delivery_and_the_worker_comes_back() -> None:
    class Once(RetryConsumer):
        queue = Q

        def __init__(self) -> None:
            self.calls = 0
            self.release = asyncio.Event()

        async def handle(self, delivery: Delivery) -> None:
            self.calls += 1
            if self.calls == 1:
                await self.release.wait()

    consumer = Once()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer) as worker:
        broker.publish(b"{}", queue=Q, message_id="r")
        await broker.wait_for(lambda: consumer.calls == 1)
        broker.disconnect()
        decisions = await broker.settle()
        assert len(worker.connections) == 2  # it reconnected
    assert [d.verdict for d in decisions] == ["unsettled", "acked"]
    assert decisions[1].message.redelivered
    assert decisions[1].message.headers["x-delivery-count"] == 1


async def test_a_copy_the_broker_cannot_route_holds_the_delivery_until_it_can(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "rabbit_retry.worker")
    consumer = Scripted({"p": ["permanent"]})
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        admin = await (await broker.connect()).channel()
        arguments = dict(broker.memory.queue(PARKING).arguments)
        await admin.queue_delete(PARKING)
        broker.publish(b"{}", queue=Q, message_id="p")
        await broker.wait_for(lambda: "publish failed" in caplog.text)
        with pytest.raises(SettleTimeout, match="holds 1 unsettled deliveries"):
            await broker.settle(within=0.05)
        assert broker.decisions == []  # held, neither acked nor lost
        await admin.queue_declare(PARKING, durable=True, arguments=arguments)
        [parked] = await broker.settle()
    assert parked.verdict == "parked"
    assert consumer.calls == [("p", 1)]
    assert "works again" in caplog.text


def test_a_blocking_handler_in_a_synchronous_test() -> None:
    class Blocking(RetryConsumer):
        queue = Q

        def __init__(self) -> None:
            self.seen: list[Any] = []

        def handle(self, delivery: Delivery) -> None:
            self.seen.append(delivery.payload)
            if delivery.payload["fail"]:
                raise Permanent("refused")

    consumer = Blocking()
    with SyncTestBroker(parse_topology(orders_yaml(), "sync.yml"), consumer) as broker:
        broker.publish(json={"fail": False}, queue=Q)
        broker.publish(json={"fail": True}, queue=Q)
        decisions = broker.settle()
    assert [d.verdict for d in decisions] == ["acked", "parked"]
    assert consumer.seen == [{"fail": False}, {"fail": True}]
