"""Traces on the in-memory broker: one span per delivery, its parent the producer's context, a
link to the attempt that made each copy, only a park an error; nothing without a tracer
provider; exemplars on the handler durations. The same story on RabbitMQ, with a park and an
operator's replay, is tests/integration/test_traces.py."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support.traces import (
    WITHOUT_OTEL,
    attempts,
    attributes,
    events,
    global_provider,
    linked,
    parent_id,
    produced,
    span_id,
    trace_id,
    traceparent,
)
from support.worker_cases import Q, orders_yaml

from rabbit_retry import Delivery, Idempotency, Permanent, RetryConsumer
from rabbit_retry.contract import COPY_SPAN
from rabbit_retry.testing import TestBroker, Verdict
from rabbit_retry.topology import naming, parse_topology
from rabbit_retry.worker.metrics import Metrics

PARKING = Q + ".parking"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with global_provider() as exporter:
        yield exporter


def broker_for(yaml: str = orders_yaml(), version: str = "4.3") -> TestBroker:
    return TestBroker(parse_topology(yaml, "in-memory.yml"), version=version)


class Flaky(RetryConsumer):
    """Fails until ``succeeds_at`` (never: 0); ``Permanent`` when ``permanent``."""

    queue = Q

    def __init__(self, succeeds_at: int = 0, permanent: bool = False) -> None:
        self.succeeds_at = succeeds_at
        self.permanent = permanent
        self.current: list[trace.Span] = []

    async def handle(self, delivery: Delivery) -> None:
        self.current.append(trace.get_current_span())
        if self.permanent:
            raise Permanent("no such customer")
        if not self.succeeds_at or delivery.attempt < self.succeeds_at:
            raise RuntimeError(f"gateway down at attempt {delivery.attempt}")


async def test_every_attempt_is_a_child_of_the_producer_and_links_to_the_one_before(
    spans: InMemorySpanExporter,
) -> None:
    consumer = Flaky(succeeds_at=3)
    async with broker_for() as broker, broker.worker(consumer):
        producer, headers = produced()
        broker.publish(json={"id": 7}, exchange="orders", routing_key="order.created",
                       message_id="m-7", correlation_id="c-7", headers=headers)
        decisions = await broker.settle(retries=True)
    assert [d.verdict for d in decisions] == [Verdict.RETRIED, Verdict.RETRIED, Verdict.ACKED]
    first, second, third = attempts(spans.get_finished_spans(), Q)
    assert {trace_id(s) for s in (first, second, third)} == {trace_id(producer)}
    assert [parent_id(s) for s in (first, second, third)] == [span_id(producer)] * 3
    assert [linked(s) for s in (first, second, third)] == [
        [], [span_id(first)], [span_id(second)]]
    # Each copy names the attempt that made it; the next attempt's link is that.
    assert decisions[0].headers[COPY_SPAN] == traceparent(first)
    assert decisions[1].headers[COPY_SPAN] == traceparent(second)
    assert [s.kind for s in (first, second, third)] == [SpanKind.CONSUMER] * 3
    assert [attributes(s)["rabbit_retry.attempt"] for s in (first, second, third)] == [1, 2, 3]
    assert [attributes(s)["rabbit_retry.outcome"] for s in (first, second, third)] == [
        "retried", "retried", "success"]
    assert [attributes(s).get("rabbit_retry.tier") for s in (first, second, third)] == [
        naming.tier_queue(Q, 300), naming.tier_queue(Q, 600), None]
    # Where it was first published, on every attempt (as Delivery says), not the tier's hop.
    for span in (first, second, third):
        assert {k: v for k, v in attributes(span).items() if k.startswith("messaging.")
                and k != "messaging.rabbitmq.message.delivery_tag"} == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": "orders",
            "messaging.rabbitmq.destination.routing_key": "order.created",
            "messaging.destination.subscription.name": Q,
            "messaging.message.id": "m-7",
            "messaging.message.conversation_id": "c-7",
        }
    # A retry is not an error: its exception is an event, its status unset.
    assert [s.status.status_code for s in (first, second, third)] == [StatusCode.UNSET] * 3
    assert [[(name, a["exception.type"]) for name, a in events(s)]
            for s in (first, second, third)] == [
        [("exception", "RuntimeError")], [("exception", "RuntimeError")], []]
    # The handler runs with its attempt's span current: its own spans are children of it.
    assert [span_id(s) for s in (first, second, third)] == [
        s.get_span_context().span_id for s in consumer.current]


async def test_only_a_park_is_an_error_and_the_parked_copy_names_its_attempt(
    spans: InMemorySpanExporter,
) -> None:
    async with broker_for() as broker, broker.worker(Flaky(permanent=True)):
        producer, headers = produced()
        broker.publish(json={"id": 8}, exchange="orders", routing_key="order.created",
                       message_id="m-8", headers=headers)
        [decision] = await broker.settle(retries=True)
    assert decision.verdict is Verdict.PARKED
    [parked] = attempts(spans.get_finished_spans(), Q)
    assert parent_id(parked) == span_id(producer)
    assert parked.status.status_code is StatusCode.ERROR
    assert parked.status.description == "parked permanent"
    found = attributes(parked)
    assert (found["rabbit_retry.outcome"], found["rabbit_retry.parked_reason"]) == (
        "parked", "permanent")
    assert found["error.type"] == "rabbit_retry.worker.consumer.Permanent"
    assert [(n, a["exception.message"]) for n, a in events(parked)] == [
        ("exception", "no such customer")]
    [copy] = broker.parked(Q)
    assert copy.headers[COPY_SPAN] == traceparent(parked)
    assert copy.headers["traceparent"] == headers["traceparent"]  # the producer's, kept


async def test_a_message_published_without_a_context_is_one_trace_from_its_first_attempt(
    spans: InMemorySpanExporter,
) -> None:
    async with broker_for() as broker, broker.worker(Flaky(succeeds_at=3)):
        broker.publish(json={"id": 9}, exchange="orders", routing_key="order.created",
                       message_id="m-9")
        decisions = await broker.settle(retries=True)
    first, second, third = attempts(spans.get_finished_spans(), Q)
    assert parent_id(first) is None  # the story starts here
    assert [parent_id(s) for s in (second, third)] == [span_id(first)] * 2
    assert {trace_id(s) for s in (first, second, third)} == {trace_id(first)}
    assert [linked(s) for s in (second, third)] == [[span_id(first)], [span_id(second)]]
    # The first copy took the first attempt's context; later copies keep it.
    assert [d.headers.get("traceparent") for d in decisions[:2]] == [traceparent(first)] * 2


async def test_the_one_tier_nack_path_keeps_the_trace_but_cannot_link(
    spans: InMemorySpanExporter,
) -> None:
    # Quorum, one delay: the broker dead-letters the message itself, and nothing can be added.
    async with broker_for(orders_yaml(delays="[300ms]")) as broker, \
            broker.worker(Flaky(succeeds_at=2)):
        producer, headers = produced()
        broker.publish(json={"id": 10}, exchange="orders", routing_key="order.created",
                       message_id="m-10", headers=headers)
        decisions = await broker.settle(retries=True)
    assert [d.verdict for d in decisions] == [Verdict.RETRIED, Verdict.ACKED]
    assert COPY_SPAN not in decisions[0].headers  # the broker's copy: nothing of ours
    first, second = attempts(spans.get_finished_spans(), Q)
    assert [parent_id(s) for s in (first, second)] == [span_id(producer)] * 2
    assert [linked(s) for s in (first, second)] == [[], []]
    assert attributes(first)["rabbit_retry.tier"] == naming.tier_queue(Q, 300)


async def test_a_forged_copy_span_from_a_publisher_is_not_linked(
    spans: InMemorySpanExporter,
) -> None:
    forged = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with broker_for() as broker, broker.worker(Flaky(succeeds_at=1)):
        broker.publish(json={}, exchange="orders", routing_key="order.created",
                       message_id="through-an-exchange", headers={COPY_SPAN: forged})
        broker.publish(json={}, queue=Q, message_id="straight-in", headers={COPY_SPAN: forged})
        await broker.settle()
    spans_by_id = {attributes(s)["messaging.message.id"]: s
                   for s in attempts(spans.get_finished_spans(), Q)}
    # Only the route every copy comes back by is believed (README, "What a publisher can...").
    assert linked(spans_by_id["through-an-exchange"]) == []
    assert linked(spans_by_id["straight-in"]) == [0xb7ad6b7169203331]


async def test_returns_and_duplicates_say_so(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    # A classic queue's delivery that came back without a verdict is sent back once, counted.
    async with broker_for(orders_yaml(queue_type="classic")) as broker, \
            broker.worker(Flaky(succeeds_at=1)):
        broker.publish(json={}, queue=Q, message_id="returned", redelivered=True)
        await broker.settle()
    returned, handled = attempts(spans.get_finished_spans(), Q)
    assert attributes(returned)["rabbit_retry.outcome"] == "returned"
    assert attributes(handled)["rabbit_retry.outcome"] == "success"
    assert attributes(handled)["rabbit_retry.returns"] == 1
    assert linked(handled) == [span_id(returned)]
    spans.clear()

    class Once(Flaky):
        idempotency = Idempotency(f"sqlite:///{tmp_path / 'keys.db'}")

    async with broker_for() as broker, broker.worker(Once(succeeds_at=1)):
        broker.publish(json={}, queue=Q, message_id="twice")
        await broker.settle()
        broker.publish(json={}, queue=Q, message_id="twice")
        await broker.settle()
    assert [attributes(s)["rabbit_retry.outcome"]
            for s in attempts(spans.get_finished_spans(), Q)] == ["success", "duplicate"]


async def test_a_blocking_handler_runs_in_its_deliverys_context(
    spans: InMemorySpanExporter,
) -> None:
    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")
    seen: list[tuple[str, int]] = []

    async def set_tenant(delivery: Delivery, call_next: object) -> None:
        tenant.set("acme")
        await call_next(delivery)  # type: ignore[operator]

    class Blocking(RetryConsumer):
        queue = Q
        middleware = (set_tenant,)

        def handle(self, delivery: Delivery) -> None:
            seen.append((tenant.get(), trace.get_current_span().get_span_context().span_id))

    async with broker_for() as broker, broker.worker(Blocking()):
        broker.publish(json={}, queue=Q, message_id="in-a-thread")
        await broker.settle()
    [span] = attempts(spans.get_finished_spans(), Q)
    assert seen == [("acme", span_id(span))]


async def test_without_a_tracer_provider_no_span_and_no_header() -> None:
    # The control of the tests above: the same retry, with nothing configured.
    async with broker_for() as broker, broker.worker(Flaky(succeeds_at=2)) as worker:
        broker.publish(json={"id": 1}, exchange="orders", routing_key="order.created",
                       message_id="m-1")
        decisions = await broker.settle(retries=True)
    assert worker.runner.trace is None
    assert [d.verdict for d in decisions] == [Verdict.RETRIED, Verdict.ACKED]
    assert COPY_SPAN not in decisions[0].headers
    assert "traceparent" not in decisions[0].headers


async def test_the_handler_duration_histogram_keeps_the_trace_id_as_exemplar(
    spans: InMemorySpanExporter,
) -> None:
    async with broker_for() as broker, broker.worker(Flaky(succeeds_at=1)) as worker:
        broker.publish(json={}, queue=Q, message_id="timed")
        await broker.settle()
        durations = worker.runner.metrics.for_queue(Q).handler_seconds
    [span] = attempts(spans.get_finished_spans(), Q)
    kept = [e for e in durations.exemplars() if e is not None]
    assert [e[0] for e in kept] == [f"{trace_id(span):032x}"]


def test_exemplars_are_served_in_the_openmetrics_format() -> None:
    from prometheus_client.openmetrics.exposition import generate_latest

    metrics = Metrics()
    metrics.keep_exemplars(lambda: "4bf92f3577b34da6a3ce929d0e0e4736")
    metrics.for_queue(Q).handler_seconds.observe(0.02)
    text = generate_latest(metrics.registry).decode()
    [line] = [x for x in text.splitlines() if 'le="0.025"' in x]
    assert line.startswith('rabbit_retry_handler_seconds_bucket{le="0.025",queue="orders.fraud-')
    assert '# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.02 ' in line
    # The classic text format has no exemplars: scrapes that ask for it read as before.
    from prometheus_client import generate_latest as classic

    assert "trace_id" not in classic(metrics.registry).decode()


def test_whether_a_process_traces() -> None:
    from rabbit_retry import tracing

    assert not tracing.active()  # no provider set: the proxy the API hands out
    assert tracing.active(True) and not tracing.active(False)
    with global_provider():
        assert tracing.active() and not tracing.active(False)
    assert not tracing.active()


def test_tracing_asked_for_without_opentelemetry_says_how_to_install() -> None:
    import subprocess
    import sys

    code = WITHOUT_OTEL + (
        "from rabbit_retry import tracing\n"
        "print(tracing.active(), tracing.active(None))\n"
        "try:\n"
        "    tracing.active(True)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider",
                                           "PATH": ""})
    assert done.stdout.splitlines() == [
        "False False",
        "InputError tracing needs OpenTelemetry: pip install 'rabbit-retry[otel]'"], done.stderr


@pytest.mark.parametrize(("version", "acquired"), [("4.0", None), ("4.3", 1)])
async def test_the_brokers_counts_of_a_returned_delivery(
    spans: InMemorySpanExporter, version: str, acquired: int | None
) -> None:
    # A quorum queue's delivery that came back once (its worker died): the broker counted it.
    async with broker_for(version=version) as broker, broker.worker(Flaky(succeeds_at=1)):
        broker.publish(json={}, queue=Q, message_id="came-back", redelivered=True)
        await broker.settle()
    [span] = attempts(spans.get_finished_spans(), Q)
    found = attributes(span)
    assert (found["rabbit_retry.outcome"], found["rabbit_retry.returns"]) == ("success", 1)
    assert found.get("rabbit_retry.acquired_count") == acquired
