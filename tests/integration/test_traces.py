"""Traces on RabbitMQ: a message published by another client (pika) that fails twice, waits in
two tiers, parks, and is replayed by an operator is one linked story (README, "Traces"); the
W3C context another client writes is honoured; ``OTEL_TRACES_EXPORTER=otlp
opentelemetry-instrument rabbit-retry worker`` exports the worker's spans with nothing in the
consumer module; the handler-duration histogram's exemplar names the trace; a desk replay is one
span that every copy carries."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pika
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support.amqp import depth, drain
from support.desk import ACCESS, access_of, desk_running
from support.parked import Parked, park
from support.poll import eventually
from support.process import CLI
from support.provision import provision, topology
from support.traces import (
    attempts,
    attributes,
    global_provider,
    linked,
    parent_id,
    produced,
    span_id,
    trace_id,
    traceparent,
)
from support.worker import running
from support.worker_cases import Q, orders_yaml

from rabbit_retry import Delivery, RetryConsumer
from rabbit_retry.contract import COPY_SPAN, REPLAY_COUNT
from rabbit_retry.parking import act, filters
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming, parse_topology

PARKING = naming.parking_queue(Q)
YAML = orders_yaml(delays="[200ms, 400ms]", attempts=3)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with global_provider() as exporter:
        yield exporter


class Gateway(RetryConsumer):
    """Down for every first life of a message; up for a replayed one."""

    queue = Q

    async def handle(self, delivery: Delivery) -> None:
        if REPLAY_COUNT not in delivery.headers:
            raise RuntimeError(f"gateway down (attempt {delivery.attempt})")


def pika_publish(settings: Settings, body: bytes, message_id: str,
                 headers: dict[str, Any]) -> None:
    """Publish as a service using pika would, through the topology's exchange, confirmed."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "orders", "order.created", body,
            pika.BasicProperties(message_id=message_id, delivery_mode=2, headers=headers,
                                 content_type="application/json"),
            mandatory=True,
        )
    finally:
        connection.close()


async def test_retried_twice_parked_and_replayed_is_one_linked_story(
    fresh_vhost: Settings, spans: InMemorySpanExporter
) -> None:
    topology = parse_topology(YAML, "traces.yml")
    await provision(fresh_vhost, topology)
    async with running([Gateway()], topology, fresh_vhost, metrics_port=0) as runner:
        producer, headers = produced()
        await asyncio.to_thread(pika_publish, fresh_vhost, b'{"order": 1}', "order-1", headers)

        async def parked() -> bool:
            return await depth(fresh_vhost, PARKING) == 1

        await eventually(parked, what="the message parked")
        outcome = await act.replay(fresh_vhost, Q, filters.selection())
        assert outcome.acted == 1
        await eventually(lambda: len(attempts(spans.get_finished_spans(), Q)) == 4,
                         what="the replayed attempt's span")
        request = urllib.request.Request(
            f"http://127.0.0.1:{runner.metrics_port}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(request).read().decode())
    finished = spans.get_finished_spans()
    first, second, third, replayed = attempts(finished, Q)
    [replay] = [s for s in finished if s.name == "parking replay"]
    story = (first, second, third, replayed)

    # One message, one trace: every attempt the producer's child, whoever published it.
    assert {trace_id(s) for s in story} == {trace_id(producer)}
    assert [parent_id(s) for s in story] == [span_id(producer)] * 4
    assert [attributes(s)["rabbit_retry.outcome"] for s in story] == [
        "retried", "retried", "parked", "success"]
    assert [attributes(s).get("rabbit_retry.tier") for s in story] == [
        naming.tier_queue(Q, 200), naming.tier_queue(Q, 400), None, None]
    assert attributes(third)["rabbit_retry.parked_reason"] == "exhausted"
    assert [attributes(s)["rabbit_retry.attempt"] for s in story] == [1, 2, 3, 1]
    # Only the park is an error.
    assert [s.status.status_code for s in story] == [
        StatusCode.UNSET, StatusCode.UNSET, StatusCode.ERROR, StatusCode.UNSET]
    # Each attempt links to the one that made its copy; the replayed one to the replay.
    assert [linked(s) for s in story] == [
        [], [span_id(first)], [span_id(second)], [span_id(replay)]]

    # The operator's action: its own span, which links back to the attempt that parked it.
    assert replay.kind is SpanKind.PRODUCER
    assert trace_id(replay) != trace_id(producer)
    assert linked(replay) == [span_id(third)]
    found = attributes(replay)
    assert (found["rabbit_retry.replay.count"], found["rabbit_retry.parking_queue"],
            found["messaging.rabbitmq.destination.routing_key"]) == (1, PARKING, Q)
    assert found["rabbit_retry.broker_user"] == fresh_vhost.user

    # A slow bucket leads to its trace: the histogram's exemplars name this message's trace.
    exemplars = [line for line in scraped.splitlines()
                 if line.startswith("rabbit_retry_handler_seconds_bucket") and "# {" in line]
    assert exemplars, scraped
    assert all(f'trace_id="{trace_id(producer):032x}"' in line for line in exemplars)


async def test_a_pika_publishers_traceparent_and_tracestate_are_honoured(
    fresh_vhost: Settings, spans: InMemorySpanExporter
) -> None:
    topology = parse_topology(orders_yaml(), "traces.yml")
    await provision(fresh_vhost, topology)

    class Fine(RetryConsumer):
        queue = Q

        async def handle(self, delivery: Delivery) -> None:
            pass

    async with running([Fine()], topology, fresh_vhost):
        await asyncio.to_thread(pika_publish, fresh_vhost, b"{}", "from-pika",
                                {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        await eventually(lambda: attempts(spans.get_finished_spans(), Q), what="its span")
    [span] = attempts(spans.get_finished_spans(), Q)
    assert parent_id(span) == 0x00f067aa0ba902b7
    assert trace_id(span) == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert span.parent is not None and span.parent.is_remote
    assert span.get_span_context().trace_state.to_header() == TRACESTATE
    assert attributes(span)["messaging.message.id"] == "from-pika"


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint on loopback: what the exporter sends, decoded."""

    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.received.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


APP = """\
from rabbit_retry import Delivery, RetryConsumer


class Fine(RetryConsumer):
    queue = "orders.fraud-check"

    async def handle(self, delivery: Delivery) -> None:
        pass
"""


async def test_opentelemetry_instrument_exports_the_workers_spans_over_otlp(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    received: list[ExportTraceServiceRequest] = []
    handler = type("Collector", (_Collector,), {"received": received})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "topology.yml").write_text(orders_yaml())
    await provision(fresh_vhost, parse_topology(orders_yaml(), "traces.yml"))
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "OTEL_SERVICE_NAME": "fraud-check",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    instrument = str(Path(CLI).with_name("opentelemetry-instrument"))
    worker = await asyncio.create_subprocess_exec(
        instrument, CLI, "--url", fresh_vhost.url, "worker", "app:Fine", "-t", "topology.yml",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        await asyncio.to_thread(pika_publish, fresh_vhost, b"{}", "instrumented",
                                {"traceparent": TRACEPARENT})

        def exported() -> list[Any]:
            return [span for request in list(received) for resource in request.resource_spans
                    for scope in resource.scope_spans for span in scope.spans]

        await eventually(exported, within=60, what="a span exported over OTLP")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(worker.communicate(), timeout=60)
        server.shutdown()
    assert worker.returncode == 0, err.decode()
    [span] = exported()
    assert span.name == f"process {Q}"
    assert span.trace_id.hex() == TRACEPARENT.split("-")[1]
    assert span.parent_span_id.hex() == TRACEPARENT.split("-")[2]
    [resource] = {json.dumps([(a.key, a.value.string_value) for a in r.resource.attributes
                              if a.key == "service.name"]) for q in received
                  for r in q.resource_spans}
    assert "fraud-check" in resource
    assert "tracing: a span per delivery" in err.decode()


DESK_TOPOLOGY = """\
version: 1
queues:
  orders:
    retry: {delays: [1s], max_attempts: 2}
"""
PARKED_BY = "00-4bf92f3577b34da6a3ce929d0e0e4736-{:016x}-01"


async def test_a_desk_replay_is_one_span_that_every_copy_carries(
    fresh_vhost: Settings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    topo = topology(DESK_TOPOLOGY)
    await provision(fresh_vhost, topo)
    # Three parked by a traced worker (the producer's context and the parking attempt's), one
    # by an untraced one.
    traced = [Parked(b"{}", message_id=f"m-{n}",
                     headers={"traceparent": TRACEPARENT, COPY_SPAN: PARKED_BY.format(n + 1)})
              for n in range(3)]
    await park(fresh_vhost, "orders", [*traced, Parked(b"{}", message_id="untraced")])
    # ana signs in: the span's actor is who the desk authenticated.
    async with desk_running(topo, fresh_vhost, f"sqlite:///{tmp_path / 'd.db'}",
                            access=access_of(ACCESS, tmp_path), as_user="ana") as client:
        async def stored() -> bool:
            return bool((await client.get("/api/overview")).json()["parked"] == 4)

        await eventually(stored, what="4 stored")
        [group] = (await client.get("/api/groups")).json()  # one cause: one group
        replayed = await client.post("/api/replay", json={"group": group["id"]})
        assert replayed.status_code == 200, replayed.text
        replay_id = replayed.json()["replay_id"]
        await eventually(lambda: [s for s in spans.get_finished_spans()
                                  if s.name == "desk replay"], what="the replay's span")
    [replay] = [s for s in spans.get_finished_spans() if s.name == "desk replay"]
    found = attributes(replay)
    assert (found["rabbit_retry.actor"], found["rabbit_retry.replay.id"],
            found["rabbit_retry.replay.count"]) == ("ana", replay_id, 4)
    assert sorted(linked(replay)) == [1, 2, 3]
    copies = {c.message_id: c.properties.headers for c in await drain(fresh_vhost, "orders")}
    assert {h[COPY_SPAN] for h in copies.values()} == {traceparent(replay)}
    # The traced ones stay in their message's trace; the untraced one joins the replay's.
    assert [copies[f"m-{n}"]["traceparent"] for n in range(3)] == [TRACEPARENT] * 3
    assert copies["untraced"]["traceparent"] == traceparent(replay)


async def test_a_desk_edit_and_replay_is_a_span_of_its_own(
    fresh_vhost: Settings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    topo = topology(DESK_TOPOLOGY)
    await provision(fresh_vhost, topo)
    await park(fresh_vhost, "orders", [Parked(b'{"v": 1}', message_id="e-1", headers={
        "traceparent": TRACEPARENT, COPY_SPAN: PARKED_BY.format(7)})])
    async with desk_running(topo, fresh_vhost, f"sqlite:///{tmp_path / 'd.db'}",
                            access=access_of(ACCESS, tmp_path), as_user="ana") as client:
        async def stored() -> bool:
            return bool((await client.get("/api/overview")).json()["parked"] == 1)

        await eventually(stored, what="1 stored")
        [row] = (await client.get("/api/messages")).json()["items"]
        edited = await client.post(f"/api/messages/{row['id']}/edit", json={"body": '{"v": 2}'})
        assert edited.status_code == 200, edited.text
        await eventually(lambda: [s for s in spans.get_finished_spans()
                                  if s.name == "desk edit and replay"], what="the edit's span")
    [edit] = [s for s in spans.get_finished_spans() if s.name == "desk edit and replay"]
    found = attributes(edit)
    assert (found["rabbit_retry.actor"], found["rabbit_retry.replay.id"],
            found["rabbit_retry.replay.count"]) == ("ana", edited.json()["replay_id"], 1)
    assert linked(edit) == [7]
    [copy] = await drain(fresh_vhost, "orders")
    assert copy.body == b'{"v": 2}' and copy.properties.headers[COPY_SPAN] == traceparent(edit)
