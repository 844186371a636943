"""Draws the README's picture of one message's trace (docs/images/trace.svg) from the spans a
real run exports: not a mock-up.

Against the broker (``RABBIT_RETRY_URL``, a throwaway vhost of its own): a checkout service
publishes an order inside its request's span; the fraud check's handler calls a scoring service
that is down, twice (the message waits in the 1 s and 2 s tiers), and a third time, which parks
it; an operator replays it (``parking replay``, as the CLI runs it), and the replayed attempt
succeeds. OpenTelemetry's SDK exports every span in memory; they are written as JSON beside the
picture (``--spans``) and drawn as a waterfall: one row per span on one time axis, the waits in
the tiers between attempts, and each link as an arrow from the span it names.

    python -m bench.trace_picture [--out docs/images/trace.svg] [--spans /tmp/trace.json]
    python -m bench.trace_picture --from /tmp/trace.json   # draw saved spans again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

from bench.common import REPO, throwaway_vhost
from rabbit_retry.settings import Settings

QUEUE = "orders.fraud-check"
TOPOLOGY = f"""\
version: 1
exchanges:
  orders: {{type: topic}}
queues:
  {QUEUE}:
    bindings: [{{exchange: orders, routing_key: order.created}}]
    retry: {{delays: [1s, 2s], max_attempts: 3}}
"""


async def record(settings: Settings) -> list[dict[str, Any]]:
    """Run the story once; every span it made, as ``span_dict`` gives them."""
    from aiormq import spec
    from opentelemetry import propagate, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from support.amqp import depth, publish_raw
    from support.poll import eventually
    from support.provision import provision
    from support.worker import running

    from rabbit_retry import Delivery, RetryConsumer
    from rabbit_retry.contract import REPLAY_COUNT, copy_properties
    from rabbit_retry.parking import act, filters
    from rabbit_retry.topology import parse_topology
    from rabbit_retry.worker.tracing import OUTCOME

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    scoring = trace.get_tracer("fraud-check")

    class FraudCheck(RetryConsumer):
        queue = QUEUE

        async def handle(self, delivery: Delivery) -> None:
            with scoring.start_as_current_span("POST /score", kind=trace.SpanKind.CLIENT):
                await asyncio.sleep(0.03)
                if REPLAY_COUNT not in delivery.headers:
                    raise ConnectionError("scoring service unavailable")

    topology = parse_topology(TOPOLOGY, "trace-picture.yml")
    await provision(settings, topology)
    async with running([FraudCheck()], topology, settings):
        checkout = trace.get_tracer("checkout")
        with checkout.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER):
            await asyncio.sleep(0.01)
            with checkout.start_as_current_span("publish orders",
                                                kind=trace.SpanKind.PRODUCER):
                headers: dict[str, Any] = {}
                propagate.inject(headers)
                properties = copy_properties(
                    spec.Basic.Properties(message_id="order-4711", delivery_mode=2,
                                          content_type="application/json"), headers)
                await publish_raw(settings, [(b'{"order": 4711}', properties)],
                                  exchange="orders", routing_key="order.created")

        async def parked() -> bool:
            return await depth(settings, f"{QUEUE}.parking") == 1

        await eventually(parked, within=60, what="the order parked")
        await asyncio.sleep(0.5)  # the operator reads the parked message first
        os.environ["LOGNAME"] = "ana"  # the operator's name, as the CLI reads it
        await act.replay(settings, QUEUE, filters.selection())

        def done() -> bool:
            return any((s.attributes or {}).get(OUTCOME) == "success"
                       for s in exporter.get_finished_spans())

        await eventually(done, within=60, what="the replayed attempt")
    provider.shutdown()
    return [span_dict(s) for s in exporter.get_finished_spans()]


def span_dict(span: Any) -> dict[str, Any]:
    """What the picture needs of a span, in the SDK's JSON words plus its tracer's name."""
    data = json.loads(span.to_json())
    data["scope"] = span.instrumentation_scope.name if span.instrumentation_scope else ""
    return data


# --- drawing ----------------------------------------------------------------------------------

ROW = 34
LEFT = 300  # names column
WIDTH = 640  # the time axis
RIGHT = 330  # what each span says
TOP = 58
COLORS = {"success": "#2e8b57", "retried": "#d98c00", "parked": "#c62828", "replay": "#6a3d9a",
          "other": "#4a78b5"}


def _time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _color(span: dict[str, Any]) -> str:
    attributes = span["attributes"]
    if span["name"].endswith("replay"):
        return COLORS["replay"]
    return COLORS.get(attributes.get("rabbit_retry.outcome", ""), COLORS["other"])


def _says(span: dict[str, Any]) -> str:
    a = span["attributes"]
    outcome = a.get("rabbit_retry.outcome")
    if outcome is not None:
        said = f"attempt {a.get('rabbit_retry.attempt')} · {outcome}"
        if "rabbit_retry.tier" in a:
            said += f" → {a['rabbit_retry.tier'].rsplit('.', 2)[-1]} tier"
        if "rabbit_retry.parked_reason" in a:
            said += f" ({a['rabbit_retry.parked_reason']}) · status ERROR"
        return said
    if "rabbit_retry.replay.count" in a:
        return (f"operator {a.get('rabbit_retry.actor')} · "
                f"{a['rabbit_retry.replay.count']} message replayed")
    if span["status"]["status_code"] == "ERROR":
        kinds = [e["attributes"].get("exception.type") for e in span.get("events", [])]
        return f"error ({kinds[0]})" if kinds and kinds[0] else "error"
    return ""


def draw(spans: list[dict[str, Any]]) -> str:
    """The waterfall as SVG text."""
    spans = sorted(spans, key=lambda s: _time(s["start_time"]))
    by_id = {s["context"]["span_id"]: s for s in spans}

    def depth(span: dict[str, Any]) -> int:
        parent, n = span.get("parent_id"), 0
        while parent in by_id:
            n += 1
            parent = by_id[parent].get("parent_id")
        return n

    start = min(_time(s["start_time"]) for s in spans)
    end = max(_time(s["end_time"]) for s in spans)
    scale = WIDTH / max(end - start, 1e-6)

    def x(t: float) -> float:
        return LEFT + (t - start) * scale

    rows = {s["context"]["span_id"]: i for i, s in enumerate(spans)}
    traces = {s["context"]["trace_id"] for s in spans}
    height = TOP + ROW * len(spans) + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + RIGHT}" '
           f'height="{height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
           'fill="#555"/></marker></defs>',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="12" y="22" font-size="15" font-weight="bold">One order, one trace: '
           f'{len([s for s in spans if "rabbit_retry.outcome" in s["attributes"]])} attempts,'
           f' two tiers, a park and a replay ({len(traces)} traces, linked)</text>',
           f'<text x="12" y="42" fill="#555">spans exported by OpenTelemetry\'s SDK from a run'
           f' on RabbitMQ (bench/trace_picture.py); {end - start:.1f} s from the first to the'
           ' last</text>']
    for second in range(int(end - start) + 1):
        gx = x(start + second)
        out.append(f'<line x1="{gx:.1f}" y1="{TOP - 6}" x2="{gx:.1f}" '
                   f'y2="{TOP + ROW * len(spans)}" stroke="#eee"/>')
        out.append(f'<text x="{gx:.1f}" y="{TOP + ROW * len(spans) + 16}" fill="#888" '
                   f'text-anchor="middle">{second} s</text>')
    for i, span in enumerate(spans):
        y = TOP + i * ROW
        left, right = x(_time(span["start_time"])), x(_time(span["end_time"]))
        indent = 12 + 14 * depth(span)
        scope = span.get("scope") or ""
        service = {"rabbit_retry": "worker"}.get(scope, scope)
        if span["name"] == "parking replay":
            service = "CLI, its own trace"
        out.append(f'<text x="{indent}" y="{y + 16}">{escape(span["name"])}'
                   f'<tspan fill="#888"> · {escape(service)}</tspan></text>')
        out.append(f'<rect x="{left:.1f}" y="{y + 5}" width="{max(right - left, 3):.1f}" '
                   f'height="16" rx="2" fill="{_color(span)}"/>')
        out.append(f'<text x="{LEFT + WIDTH + 14}" y="{y + 16}" fill="#333">'
                   f'{escape(_says(span))}</text>')
        for link in span.get("links", []):
            target = link["context"]["span_id"]
            if target not in by_id:
                continue
            linked = by_id[target]
            tx, ty = x(_time(linked["end_time"])), TOP + rows[target] * ROW + 21
            sy = y + 13
            tier = linked["attributes"].get("rabbit_retry.tier")
            if tier is not None:  # the wait in the tier, on the linking span's row
                out.append(f'<line x1="{tx:.1f}" y1="{sy}" x2="{left:.1f}" y2="{sy}" '
                           'stroke="#d98c00" stroke-dasharray="4 3"/>')
                out.append(f'<text x="{(tx + left) / 2:.1f}" y="{y + 4}" fill="#a66a00" '
                           f'font-size="10" text-anchor="middle">waiting in '
                           f'{escape(tier)}</text>')
            out.append(f'<path d="M{tx:.1f},{ty} C{tx + 30:.1f},{ty + 8} {left - 30:.1f},'
                       f'{sy - 8} {left - 1:.1f},{sy}" fill="none" stroke="#555" '
                       'stroke-width="1.2" marker-end="url(#arrow)"/>')
    legend_y = TOP + ROW * len(spans) + 40
    items = [("success", "success"), ("retried", "retried (exception recorded as an event)"),
             ("parked", "parked (status ERROR)"), ("replay", "operator's replay"),
             ("other", "producer and handler spans")]
    lx = 12
    for key, label in items:
        out.append(f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" '
                   f'fill="{COLORS[key]}"/>')
        out.append(f'<text x="{lx + 17}" y="{legend_y}">{escape(label)}</text>')
        lx += 30 + 7 * len(label)
    out.append(f'<text x="{lx}" y="{legend_y}" fill="#555">→ a link (copy-span)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "trace.svg")
    parser.add_argument("--spans", type=Path, help="also write the exported spans here (JSON)")
    parser.add_argument("--from", dest="source", type=Path,
                        help="draw the spans saved in this file instead of running the story")
    args = parser.parse_args()
    if args.source is not None:
        spans = json.loads(args.source.read_text())
    else:
        with throwaway_vhost(Settings.from_env(), "trace") as scoped:
            spans = asyncio.run(record(scoped))
        if args.spans is not None:
            args.spans.write_text(json.dumps(spans, indent=1))
    args.out.write_text(draw(spans))
    print(f"wrote {args.out} ({len(spans)} spans)")


if __name__ == "__main__":
    main()
