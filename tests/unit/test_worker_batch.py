"""Batch handlers on the in-memory broker: each delivery of a batch takes its own path (acked,
retried through its own tier with its own count, parked with its own reason and headers), the
successes are acked together, and a batch works with a model, idempotency, a pause, timeouts and
a stop. Milliseconds each."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from support.worker_cases import Q, orders_yaml

from rabbit_retry import Batch, BatchResult, Delivery, Idempotency, Pause, Permanent, RetryConsumer
from rabbit_retry.errors import InputError
from rabbit_retry.testing import TestBroker, Verdict
from rabbit_retry.testing.amqp import Channel
from rabbit_retry.topology import parse_topology
from rabbit_retry.worker.batch import BatchError, outcomes
from rabbit_retry.worker.consumer import ack_run, check_consumer, prefetch
from rabbit_retry.worker.decide import Outcome

PARKING = Q + ".parking"
VERSIONS = ("3.10", "4.0", "4.3")


def broker_for(yaml: str, version: str = "4.3") -> TestBroker:
    return TestBroker(parse_topology(yaml, "in-memory.yml"), version=version)


class Unknown(KeyError):
    """A consumer's permanent error type."""


class Loader(RetryConsumer):
    """Fails each delivery as ``script[message_id]`` says for its attempt: "ok", "fail",
    "permanent" (Permanent), "unknown" (a permanent_errors type); records every batch."""

    queue = Q
    batch = Batch(size=4, wait=0.05)
    permanent_errors = (Unknown,)

    def __init__(self, script: dict[str, list[str]] | None = None) -> None:
        self.script = script or {}
        self.batches: list[list[tuple[str | None, int]]] = []

    async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
        self.batches.append([(d.message_id, d.attempt) for d in deliveries])
        failed: dict[Delivery, BaseException] = {}
        for d in deliveries:
            steps = self.script.get(d.message_id or "", ["ok"])
            step = steps[min(d.attempt, len(steps)) - 1]
            if step == "fail":
                failed[d] = RuntimeError(f"{d.message_id} failed at attempt {d.attempt}")
            elif step == "permanent":
                failed[d] = Permanent(f"{d.message_id}: no such sku")
            elif step == "unknown":
                failed[d] = Unknown(d.message_id)
        return BatchResult(failed=failed) if failed else None


@pytest.fixture
def acks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """Every ``basic.ack`` frame the worker sends: (tag, multiple)."""
    sent: list[tuple[int, bool]] = []
    ack = Channel.basic_ack

    async def recording(self: Channel, delivery_tag: int, multiple: bool = False,
                        wait: bool = True) -> None:
        sent.append((delivery_tag, multiple))
        await ack(self, delivery_tag, multiple, wait)

    monkeypatch.setattr(Channel, "basic_ack", recording)
    yield sent


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_each_delivery_of_a_batch_takes_its_own_path(version: str, queue_type: str) -> None:
    consumer = Loader({"flaky": ["fail", "ok"], "ghost": ["permanent"], "sku": ["unknown"]})
    yaml = orders_yaml(queue_type=queue_type, delays="[1s]" if queue_type == "quorum"
                       else "[300ms, 600ms]")
    async with broker_for(yaml, version) as broker, broker.worker(consumer):
        for message_id in ("fine", "flaky", "ghost", "sku"):
            broker.publish(json={"id": message_id}, exchange="orders",
                           routing_key="order.created", message_id=message_id)
        decisions = {d.message_id: d for d in await broker.settle()}
        assert decisions["fine"].verdict == Verdict.ACKED
        flaky = decisions["flaky"]
        assert flaky.verdict == Verdict.RETRIED
        assert flaky.tier == (f"{Q}.retry.1s" if queue_type == "quorum" else f"{Q}.retry.300ms")
        if flaky.headers.get("retry-count") is not None:  # a copy (not the broker's nack)
            assert flaky.headers["retry-count"] == 1
            assert flaky.headers["exception-message"] == "flaky failed at attempt 1"
        ghost, sku = decisions["ghost"], decisions["sku"]
        assert (ghost.verdict, ghost.reason) == (Verdict.PARKED, "permanent")
        assert ghost.headers["exception-message"] == "ghost: no such sku"
        assert ghost.headers["exception-type"] == "rabbit_retry.worker.consumer.Permanent"
        assert ghost.headers["retry-count"] == 1
        assert (sku.verdict, sku.reason) == (Verdict.PARKED, "permanent")
        assert sku.headers["exception-type"].endswith("Unknown")
        assert ghost.message.json() == {"id": "ghost"}  # the body byte for byte
        retried = await broker.settle(retries=True)
        assert [(d.message_id, d.verdict) for d in retried] == [("flaky", Verdict.ACKED)]
        assert sorted(m.message_id or "" for m in broker.parked(Q)) == ["ghost", "sku"]
    assert consumer.batches == [[("fine", 1), ("flaky", 1), ("ghost", 1), ("sku", 1)],
                                [("flaky", 2)]]


async def test_each_failed_delivery_counts_its_own_attempts_and_parks_exhausted_alone() -> None:
    """Two deliveries fail together in every batch; the one that arrived with two failures
    behind it parks ``exhausted`` at its fourth attempt while the fresh one is retried."""
    consumer = Loader({"old": ["fail"] * 9, "new": ["fail", "fail", "ok"]})
    async with broker_for(orders_yaml(queue_type="classic", attempts=4)) as broker, \
            broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="old", headers={"retry-count": 2})
        broker.publish(b"{}", queue=Q, message_id="new")
        first = {d.message_id: d for d in await broker.settle()}
        assert first["old"].headers["retry-count"] == 3
        assert first["new"].headers["retry-count"] == 1
        assert first["old"].tier == f"{Q}.retry.600ms"  # its own tier
        assert first["new"].tier == f"{Q}.retry.300ms"
        rest = await broker.settle(retries=True)
    [parked] = broker.parked(Q)
    assert (parked.message_id, parked.headers["parked-reason"]) == ("old", "exhausted")
    assert parked.headers["retry-count"] == 4
    assert [(d.message_id, d.verdict) for d in rest][-1] == ("new", Verdict.ACKED)
    assert [attempt for batch in consumer.batches for (mid, attempt) in batch
            if mid == "new"] == [1, 2, 3]


async def test_the_successes_of_a_batch_are_acked_in_one_frame(
    acks: list[tuple[int, bool]],
) -> None:
    class Big(Loader):
        batch = Batch(size=50, wait=5.0)

    consumer = Big({"m-7": ["permanent"]})
    async with broker_for(orders_yaml()) as broker:
        for i in range(50):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        async with broker.worker(consumer):
            decisions = await broker.settle()
    assert Counter(d.verdict for d in decisions) == {Verdict.ACKED: 49, Verdict.PARKED: 1}
    assert [len(b) for b in consumer.batches] == [50]  # full: the 5 s wait never ran out
    # 49 successes and the parked one (acked once its copy was confirmed): one frame.
    assert acks == [(50, True)]


async def test_a_batch_is_handed_over_at_its_size_or_after_its_wait() -> None:
    class Three(Loader):
        batch = Batch(size=3, wait=0.05)
        prefetch = 3  # one batch in flight at a time: the sizes are exact

    consumer = Three()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        await broker.settle()  # past probation, at full prefetch
        for i in range(7):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        decisions = await broker.settle()
    assert len(decisions) == 7
    assert [len(b) for b in consumer.batches] == [3, 3, 1]  # the last after its wait
    assert [mid for b in consumer.batches for mid, _ in b] == [f"m-{i}" for i in range(7)]


async def test_raising_fails_every_delivery_of_the_batch_with_that_exception() -> None:
    class Down(Loader):
        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            if len(self.batches) == 1:
                raise ConnectionError("warehouse down")
            return None

    consumer = Down()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        for i in range(3):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        first = await broker.settle()
        assert [d.verdict for d in first] == [Verdict.RETRIED] * 3
        assert {d.headers["exception-message"] for d in first} == {"warehouse down"}
        assert {d.headers["exception-type"] for d in first} == {"ConnectionError"}
        second = await broker.settle(retries=True)
    assert Counter(d.verdict for d in second) == {Verdict.ACKED: 3}


async def test_a_result_naming_a_delivery_not_in_the_batch_fails_the_batch_retried() -> None:
    class Wrong(Loader):
        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            if len(self.batches) == 1:  # keyed by message id, not by the Delivery
                return BatchResult(failed={d.message_id: Permanent("x") for d in deliveries})
            return None

    consumer = Wrong()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="m-0")
        [first] = await broker.settle()
        assert first.verdict == Verdict.RETRIED  # retried, not parked nor taken for done
        assert first.headers["exception-type"] == "rabbit_retry.worker.batch.BatchError"
        assert "names 'm-0', which is not one of the deliveries" in \
            first.headers["exception-message"]
        [second] = await broker.settle(retries=True)
    assert second.verdict == Verdict.ACKED


async def test_a_handler_that_sorts_or_empties_its_list_keeps_each_outcome_on_its_delivery(
) -> None:
    """The handler gets a list of its own: sorted in place, the failure stays on the delivery
    it names (before, "good" parked and "bad" was acked); emptied, the batch still settles."""

    class Sorting(Loader):
        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            deliveries.sort(key=lambda d: d.message_id or "", reverse=True)
            failed = {d: Permanent("no such sku") for d in deliveries if d.message_id == "bad"}
            deliveries.clear()
            return BatchResult(failed=failed)

    consumer = Sorting()
    consumer.batch = Batch(size=3, wait=0.05)
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        for mid in ("bad", "good", "also-good"):
            broker.publish(b"{}", queue=Q, message_id=mid)
        decisions = {d.message_id: d.verdict for d in await broker.settle()}
    assert consumer.batches == [[("bad", 1), ("good", 1), ("also-good", 1)]]
    assert decisions == {"bad": Verdict.PARKED, "good": Verdict.ACKED,
                         "also-good": Verdict.ACKED}


@pytest.mark.parametrize("failed", [[0], None, {0}], ids=["list", "none", "set"])
async def test_a_result_whose_failed_is_not_a_mapping_fails_the_batch_retried(
    failed: Any,
) -> None:
    """Before, ``failed.items()`` raised inside the batch's task, which cancelled every
    delivery: each stayed unacked until its channel closed, and the prefetch ran out."""

    class Malformed(Loader):
        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            if len(self.batches) == 1:
                return BatchResult(failed=failed)
            return None

    consumer = Malformed()
    consumer.batch = Batch(size=2, wait=0.05)
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="a")
        broker.publish(b"{}", queue=Q, message_id="b")
        first = await broker.settle()
        assert {d.message_id: d.verdict for d in first} == {"a": Verdict.RETRIED,
                                                            "b": Verdict.RETRIED}
        assert {d.headers["exception-type"] for d in first} == {
            "rabbit_retry.worker.batch.BatchError"}
        assert {d.headers["exception-message"] for d in first} == {
            f"BatchResult.failed is {type(failed).__name__}; expected a mapping of the failed"
            " deliveries to their exceptions"}
        second = await broker.settle(retries=True)
    assert {d.message_id: d.verdict for d in second} == {"a": Verdict.ACKED, "b": Verdict.ACKED}


async def test_a_result_the_worker_cannot_split_is_retried_even_with_typeerror_permanent(
) -> None:
    """``BatchError`` is not a ``TypeError`` and is always transient: a consumer listing
    ``TypeError`` (or ``Exception``) as permanent does not park its batch for it."""

    class Strict(Loader):
        permanent_errors = (TypeError, Exception)

        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            return BatchResult(failed={d.message_id: RuntimeError("x") for d in deliveries})

    async with broker_for(orders_yaml()) as broker, broker.worker(Strict()):
        broker.publish(b"{}", queue=Q, message_id="m")
        [decision] = await broker.settle()
    assert decision.verdict == Verdict.RETRIED


async def test_a_batch_past_its_timeout_fails_every_delivery_with_the_timeout() -> None:
    class Slow(Loader):
        handler_timeout = 0.05

        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            if len(self.batches) == 1:
                await asyncio.sleep(60)
            return None

    consumer = Slow()
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="a")
        broker.publish(b"{}", queue=Q, message_id="b")
        first = await broker.settle()
        assert [d.verdict for d in first] == [Verdict.RETRIED] * 2
        assert {d.headers["exception-type"] for d in first} == {
            "rabbit_retry.worker.consumer.HandlerTimeout"}
        assert Counter(d.verdict for d in await broker.settle(retries=True)) == {
            Verdict.ACKED: 2}


class Order(BaseModel):
    sku: str
    quantity: int


async def test_an_invalid_body_parks_before_the_batch_and_the_batch_gets_models() -> None:
    seen: list[Any] = []

    class Typed(RetryConsumer[Order]):
        queue = Q
        batch = Batch(size=10, wait=0.02)

        async def handle_batch(self, deliveries: list[Delivery[Order]]) -> BatchResult | None:
            seen.extend(d.payload for d in deliveries)
            return None

    async with broker_for(orders_yaml()) as broker, broker.worker(Typed()):
        broker.publish(json={"sku": "a", "quantity": 1}, queue=Q, message_id="good")
        broker.publish(json={"sku": "b"}, queue=Q, message_id="bad")
        decisions = {d.message_id: d for d in await broker.settle()}
    assert decisions["good"].verdict == Verdict.ACKED
    assert (decisions["bad"].verdict, decisions["bad"].reason) == (Verdict.PARKED, "invalid")
    assert seen == [Order(sku="a", quantity=1)]


async def test_idempotency_keeps_a_duplicate_out_of_the_batch(tmp_path: Path) -> None:
    class Once(Loader):
        idempotency = Idempotency(f"sqlite:///{tmp_path / 'dedupe.db'}", window=3600)

    consumer = Once({"f": ["fail", "ok"]})
    async with broker_for(orders_yaml()) as broker, broker.worker(consumer):
        broker.publish(b"{}", queue=Q, message_id="k")
        broker.publish(b"{}", queue=Q, message_id="f")
        await broker.settle(retries=True)
        broker.publish(b"{}", queue=Q, message_id="k")  # done already
        broker.publish(b"{}", queue=Q, message_id="f")  # done already (on its retry)
        broker.publish(b"{}", queue=Q, message_id="new")
        decisions = await broker.settle()
    assert [d.verdict for d in decisions] == [Verdict.ACKED] * 3
    handled = [mid for batch in consumer.batches for mid, _ in batch]
    assert Counter(handled) == {"k": 1, "f": 2, "new": 1}  # f: its failure, then its retry


async def test_a_pause_hears_each_failure_of_a_batch() -> None:
    class Gateway(Loader):
        pause = Pause(after=3, on=(ConnectionError,), probe_every=0.05)
        up = True

        async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
            self.batches.append([(d.message_id, d.attempt) for d in deliveries])
            if not self.up:
                return BatchResult(failed={d: ConnectionError("down") for d in deliveries})
            return None

    consumer = Gateway()
    async with broker_for(orders_yaml(delays="[1s]", attempts=3)) as broker, \
            broker.worker(consumer) as worker:
        broker.publish(b"{}", queue=Q, message_id="first")
        await broker.settle()  # past probation
        consumer.up = False
        for i in range(3):
            broker.publish(b"{}", queue=Q, message_id=f"c-{i}")
        tripped = await broker.settle()
        metrics = worker.runner.metrics.for_queue(Q)
        assert [d.verdict for d in tripped] == [Verdict.RETRIED] * 3
        assert metrics.paused == 1  # three different messages failed in a row
        consumer.up = True
        await broker.advance(1)  # the three come back from their tier to the paused queue
        await broker.settle(expect=1)  # a probe: a batch of one, and it succeeds
        assert metrics.paused == 0
        assert [1] in [[len(b)] for b in consumer.batches[2:]]
        await broker.settle(retries=True)
    assert broker.parked(Q) == []


async def test_a_returned_delivery_is_a_batch_of_its_own() -> None:
    consumer = Loader()
    async with broker_for(orders_yaml()) as broker:
        broker.publish(b"{}", queue=Q, message_id="returned", redelivered=True)
        for i in range(3):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        async with broker.worker(consumer):
            decisions = await broker.settle()
    assert Counter(d.verdict for d in decisions) == {Verdict.ACKED: 4}
    assert [("returned", 1)] in consumer.batches
    assert any(len(b) > 1 for b in consumer.batches)  # positive control: the others batch


async def test_a_stop_hands_over_what_was_collected_without_waiting_for_the_wait() -> None:
    class Patient(Loader):
        batch = Batch(size=100, wait=3600)

    consumer = Patient()
    async with broker_for(orders_yaml()) as broker:
        for i in range(3):
            broker.publish(b"{}", queue=Q, message_id=f"m-{i}")
        async with broker.worker(consumer) as worker:
            await broker.wait_for(lambda: len(broker.messages(Q)) == 0, what="all taken")
            await worker.stop()
        assert broker.messages(Q) == []
    assert sorted(mid for b in consumer.batches for mid, _ in b) == ["m-0", "m-1", "m-2"]
    assert Counter(d.verdict for d in broker.decisions) == {Verdict.ACKED: 3}


async def test_a_delivery_that_joins_after_the_stop_began_runs_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A delivery still in its idempotency check when the stop hands the collected batch over
    joins after it: it runs at once, as a batch of its own, instead of waiting for the batch's
    ``wait`` (an hour here) until the grace ran out and going back unhandled."""
    from rabbit_retry.worker import dedupe

    admit = dedupe.Deduper.admit
    checking = asyncio.Event()

    async def slow_admit(self: Any, *args: Any, **kwargs: Any) -> Any:
        checking.set()
        await asyncio.sleep(0.3)
        return await admit(self, *args, **kwargs)

    monkeypatch.setattr(dedupe.Deduper, "admit", slow_admit)

    class Patient(Loader):
        batch = Batch(size=100, wait=3600)
        idempotency = Idempotency(f"sqlite:///{tmp_path / 'seen.db'}", window=3600)

    consumer = Patient()
    async with broker_for(orders_yaml()) as broker:
        broker.publish(b"{}", queue=Q, message_id="m-0")
        async with broker.worker(consumer, grace=30.0) as worker:
            await checking.wait()
            await asyncio.wait_for(worker.stop(), 10)  # the grace (30 s) would fail it
        assert broker.messages(Q) == []
    assert consumer.batches == [[("m-0", 1)]]
    assert [d.verdict for d in broker.decisions] == [Verdict.ACKED]


@pytest.mark.parametrize(("limit", "lease"), [(10.0, 20.0 + 10.0 + 30.0), (None, 20.0 + 300.0)])
async def test_a_batch_consumers_idempotency_claim_outlasts_its_wait_for_the_batch(
    tmp_path: Path, limit: float | None, lease: float
) -> None:
    """A delivery claims its key before it waits for its batch: the default lease covers that
    wait too, or a claim could run out while its delivery still waits and a duplicate take it."""

    class Slow(Loader):
        batch = Batch(size=100, wait=20.0)
        handler_timeout = limit
        idempotency = Idempotency(f"sqlite:///{tmp_path / 'seen.db'}")

    async with broker_for(orders_yaml()) as broker, broker.worker(Slow()) as worker:
        await broker.wait_for(lambda: worker.runner.ready.is_set(), what="the worker ready")
        [deduper] = [s.deduper for s in worker.runner.subscriptions]
    assert deduper is not None and deduper.lease == lease


# --- the outcome per delivery (pure) -------------------------------------------------------------


def _deliveries(n: int) -> list[Delivery]:
    return [Delivery(b"", {}, f"m-{i}", None, "k", "x", Q, 1, 3) for i in range(n)]


def test_outcomes_none_is_all_success_and_failed_ones_keep_their_exception() -> None:
    a, b, c = _deliveries(3)
    assert outcomes([a, b, c], None) == [Outcome.SUCCESS] * 3
    error = ValueError("bad")
    assert outcomes([a, b, c], BatchResult(failed={b: error})) == [
        Outcome.SUCCESS, error, Outcome.SUCCESS]
    twin = Delivery(b"", {}, "m-1", None, "k", "x", Q, 1, 3)  # equal fields, another delivery
    [wrong] = set(map(type, outcomes([a, b], BatchResult(failed={twin: error}))))
    assert wrong is BatchError
    [kind] = {type(o) for o in outcomes([a], BatchResult(failed={a: "no"}))}  # type: ignore[dict-item]
    assert kind is BatchError
    [returned] = {str(o) for o in outcomes([a, b], [a])}
    assert returned == "handle_batch returned list; expected BatchResult or None"


# --- a misdeclared batch consumer is refused before the first message -----------------------------


def _refusal(**attributes: Any) -> str:
    base: dict[str, Any] = {"queue": Q, "batch": Batch(size=10)}

    async def handle_batch(self: Any, deliveries: list[Delivery]) -> None:
        return None

    base["handle_batch"] = handle_batch
    base.update(attributes)
    klass = type("Bulk", (RetryConsumer,), {k: v for k, v in base.items() if v is not ...})
    with pytest.raises(InputError) as caught:
        check_consumer(klass())
    return str(caught.value)


def test_bad_batch_declarations_are_one_line_each() -> None:
    assert _refusal(batch=...) == "Bulk: handle_batch needs batch = Batch(size=N, wait=SECONDS)"
    assert _refusal(batch=Batch(size=0)) == \
        "Bulk.batch: size must be an integer from 1 to 65535, got 0"
    assert _refusal(batch=Batch(size=5, wait=0)) == \
        "Bulk.batch: wait must be a positive number of seconds, got 0"
    assert _refusal(batch=500) == "Bulk.batch: expected Batch(size=N, wait=SECONDS), got 500"
    assert _refusal(handle_batch=...) == \
        "Bulk: batch is set; define async def handle_batch(self, deliveries)"
    assert _refusal(handle_batch=lambda self, d: None) == \
        "Bulk.handle_batch: must be an async def"
    assert _refusal(prefetch=5) == ("Bulk.prefetch = 5 is below batch size 10: a batch could "
                                    "never fill (leave prefetch unset: twice the batch size)")
    assert _refusal(middleware=(lambda d, call_next: call_next(d),)).startswith(
        "Bulk.middleware: runs around handle, which a batch consumer does not have")


def test_a_batch_consumer_holds_two_batches_and_acks_a_batch_per_frame() -> None:
    consumer = Loader()
    check_consumer(consumer)  # positive control: a good one passes
    assert (prefetch(consumer), ack_run(consumer)) == (8, 4)

    class Set(Loader):
        prefetch = 6

    assert prefetch(Set()) == 6
