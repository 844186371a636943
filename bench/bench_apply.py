"""How fast ``apply`` provisions a big topology, and how cheap a no-op re-apply is.

A generated topology of QUEUES queues with TIERS retry tiers each (about 1000 queues at the
defaults, most of them quorum) is applied to a fresh throwaway vhost the way ``rabbit-retry
apply`` does it (management API read, diff, concurrent declarations over a channel pool), then
re-applied several times with nothing to do. The baseline declares the same objects the naive
way, one RPC at a time on one channel, in another fresh vhost. The two are run alternately,
order rotated each round, and medians reported; every vhost is deleted on the way out.

    python -m bench.bench_apply [--queues 200] [--tiers 3] [--runs 3] [--concurrency 16]

RabbitMQ 3.x reserves three file handles per quorum queue out of the node's open-file limit,
and once they run out every queue declaration on the node stalls; on such a broker the bench
measures the full size all classic, plus the largest mostly-quorum topology that fits.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aio_pika
from aio_pika.abc import AbstractExchange

from bench.common import (
    alternate,
    leftover_vhosts,
    median,
    ratio,
    result,
    say,
    throwaway_vhost,
)
from rabbit_retry.broker.declare import DEFAULT_CONCURRENCY, apply_changes
from rabbit_retry.broker.diff import capacity_problem, count, diff, nothing_to_do
from rabbit_retry.broker.inspect import NodeCapacity, read_capacity, read_live
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Plan, compile_topology, parse_topology

DELAYS = ("1s", "10s", "1m", "5m", "30m", "1h")
NOOP_REPEATS = 3


def topology_yaml(queues: int, tiers: int, classic_every: int = 5) -> str:
    """``queues`` queues bound to one topic exchange; every ``classic_every``-th is classic."""
    delays = ", ".join(DELAYS[:tiers])
    lines = [
        "version: 1",
        f"defaults: {{queue_type: quorum, retry: {{delays: [{delays}], max_attempts: 5}}}}",
        "exchanges: {bench: {type: topic}}",
        "queues:",
    ]
    for i in range(queues):
        lines.append(f"  bench.q{i:04d}:")
        if i % classic_every == classic_every - 1:
            lines.append("    queue_type: classic")
        lines.append(f"    bindings: [{{exchange: bench, routing_key: 'q{i:04d}.#'}}]")
    return "\n".join(lines) + "\n"


def apply_once(settings: Settings, plan: Plan, concurrency: int) -> tuple[float, int]:
    """What ``rabbit-retry apply`` does after loading the file: seconds taken, operations sent."""
    start = time.perf_counter()
    with Management(settings.management_url) as api:
        live = read_live(api, settings.vhost)
    changes = diff(plan, live)
    if nothing_to_do(changes):
        return time.perf_counter() - start, 0
    report = asyncio.run(apply_changes(settings, changes, live.bindings, concurrency=concurrency))
    return time.perf_counter() - start, len(report.created) + len(report.unbound)


async def naive_declare(settings: Settings, plan: Plan) -> None:
    """The baseline: every object of the plan declared over one aio-pika channel, one at a time
    (what a script that loops over the plan would do)."""
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        exchanges: dict[str, AbstractExchange] = {}
        for ex in plan.exchanges:
            exchanges[ex.name] = await channel.declare_exchange(
                ex.name,
                ex.type,
                durable=ex.durable,
                auto_delete=ex.auto_delete,
                internal=ex.internal,
                arguments=dict(ex.arguments),
            )
        for q in plan.queues:
            await channel.declare_queue(q.name, durable=q.durable, arguments=dict(q.arguments))
        for b in plan.bindings:
            queue = await channel.get_queue(b.destination, ensure=False)
            await queue.bind(exchanges[b.source], b.routing_key, arguments=dict(b.arguments))


def naive_once(settings: Settings, plan: Plan) -> float:
    start = time.perf_counter()
    asyncio.run(naive_declare(settings, plan))
    return time.perf_counter() - start


def measure(
    settings: Settings, plan: Plan, runs: int, concurrency: int
) -> tuple[dict[str, list[float]], list[float], int]:
    """Alternating runs of ``apply`` (then no-op re-applies) and the naive declare."""
    noop: list[float] = []
    operations: list[int] = []

    def concurrent() -> float:
        with throwaway_vhost(settings, "apply") as vhost:
            seconds, sent = apply_once(vhost, plan, concurrency)
            operations.append(sent)
            for _ in range(NOOP_REPEATS):
                again, sent_again = apply_once(vhost, plan, concurrency)
                if sent_again:
                    raise RuntimeError(f"no-op re-apply sent {sent_again} operations")
                noop.append(again)
            with Management(vhost.management_url) as api:
                left = count(diff(plan, read_live(api, vhost.vhost)))
            if left["unchanged"] != len(plan.exchanges) + len(plan.queues) + len(plan.bindings):
                raise RuntimeError(f"apply left work undone: {left}")
            return seconds

    def naive() -> float:
        with throwaway_vhost(settings, "naive") as vhost:
            return naive_once(vhost, plan)

    samples = alternate(runs, {"apply": concurrent, "naive": naive}, log=say)
    return samples, noop, operations[0] if operations else 0


def describe(plan: Plan) -> str:
    quorum = sum(1 for q in plan.queues if q.queue_type == "quorum")
    return (
        f"{len(plan.queues)} queues ({quorum} quorum), {len(plan.exchanges)} exchanges, "
        f"{len(plan.bindings)} bindings"
    )


def quorum_count(queues: int, tiers: int, classic_every: int) -> int:
    """Quorum queues in ``topology_yaml(queues, tiers, classic_every)``: main, tiers and the
    parking queue (it follows the main queue's type)."""
    return (queues - queues // classic_every) * (tiers + 2)


def fitting_queues(capacity: NodeCapacity, tiers: int, classic_every: int) -> int:
    """How many mostly-quorum queues fit in half the quorum room the broker has left."""
    for n in range(1000, 0, -1):
        if capacity_problem(capacity, 2 * quorum_count(n, tiers, classic_every)) is None:
            return n
    return 0


def run(
    settings: Settings,
    queues: int = 200,
    tiers: int = 3,
    runs: int = 3,
    concurrency: int = DEFAULT_CONCURRENCY,
    classic_every: int = 5,
) -> dict[str, Any]:
    """Measures ``queues`` x ``tiers`` (every ``classic_every``-th queue classic, the rest
    quorum). On a broker whose file handle cache cannot hold that many quorum queues (RabbitMQ
    3.x with a low open-file limit; declaring them would stall the whole node) it measures the
    same size all classic, plus the largest mostly-quorum topology that fits."""
    with Management(settings.management_url) as api:
        capacity = read_capacity(api)
    wanted = compile_topology(parse_topology(topology_yaml(queues, tiers, classic_every)))
    quorum = sum(1 for q in wanted.queues if q.queue_type == "quorum")
    assert quorum == quorum_count(queues, tiers, classic_every)
    problem = capacity_problem(capacity, quorum * 2)  # the naive vhost may still be deleting
    scenarios: list[tuple[str, Plan]] = []
    notes: list[str] = []
    if problem is None:
        kind = "all classic" if quorum == 0 else "mostly quorum"
        scenarios.append((f"{queues} x {tiers} tiers, {kind}", wanted))
    else:
        notes.append(f"{queues} x {tiers} mostly quorum not measured on this broker: {problem}")
        classic = compile_topology(parse_topology(topology_yaml(queues, tiers, 1)))
        scenarios.append((f"{queues} x {tiers} tiers, all classic", classic))
        fits = fitting_queues(capacity, tiers, classic_every)
        if fits:
            smaller = compile_topology(parse_topology(topology_yaml(fits, tiers, classic_every)))
            scenarios.append((f"{fits} x {tiers} tiers, mostly quorum", smaller))

    rows: list[list[str]] = []
    headline: dict[str, Any] = {}
    samples_out: dict[str, list[float]] = {}
    for label, plan in scenarios:
        say(f"bench_apply: {label}: {describe(plan)}; {runs} runs, concurrency {concurrency}")
        samples, noop, operations = measure(settings, plan, runs, concurrency)
        first, again, baseline = median(samples["apply"]), median(noop), median(samples["naive"])
        rows += [
            [label, "apply, first run (concurrent)", f"{first:.2f}", "1.00"],
            [label, "apply, no-op re-run", f"{again:.3f}", f"{ratio(again, first):.3f}"],
            [
                label,
                "naive: one channel, one declare at a time",
                f"{baseline:.2f}",
                f"{ratio(baseline, first):.2f}",
            ],
        ]
        key = label.replace(" ", "_").replace(",", "")
        headline |= {
            f"{key}.first_apply_s": round(first, 3),
            f"{key}.noop_apply_s": round(again, 4),
            f"{key}.naive_s": round(baseline, 3),
            f"{key}.speedup_vs_naive": round(ratio(baseline, first), 2),
        }
        notes.append(
            f"{label}: {describe(plan)}; {operations} AMQP operations on first apply, 0 on "
            f"every re-apply; medians of {runs} alternating runs, no-op of {len(noop)}"
        )
        samples_out |= {
            f"{label}: apply": samples["apply"],
            f"{label}: naive": samples["naive"],
            f"{label}: no-op": noop,
        }
    leftovers = leftover_vhosts(settings)
    if leftovers:
        raise RuntimeError(f"vhosts left behind: {leftovers}")
    return result(
        "apply: a big topology, first run and no-op re-run",
        ["topology", "what", "median seconds", "x first apply"],
        rows,
        headline=headline,
        goal="a 200-queue, three-tier topology applies in seconds; a no-op re-apply is faster "
        "still and sends no AMQP declarations",
        notes=notes,
        params={
            "queues": queues,
            "tiers": tiers,
            "runs": runs,
            "concurrency": concurrency,
            "classic_every": classic_every,
            "broker": capacity.version,
            "broker_open_files": capacity.fd_total,
        },
        samples=samples_out,
        sample_unit="s",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=200)
    parser.add_argument("--tiers", type=int, default=3, choices=range(1, len(DELAYS) + 1))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--classic-every", type=int, default=5, help="1: all classic")
    parser.add_argument("--url", help="AMQP URL of the broker (its vhost is ignored)")
    parser.add_argument("--management-url", help="management API URL")
    args = parser.parse_args()
    settings = Settings.from_env(args.url, args.management_url)
    out = run(settings, args.queues, args.tiers, args.runs, args.concurrency, args.classic_every)
    print(out["title"])
    for row in out["rows"]:
        print(f"  {row[0]:<34} {row[1]:<42} {row[2]:>8} s  {row[3]:>6} x")
    for note in out["notes"]:
        print(f"  {note}")


if __name__ == "__main__":
    main()
