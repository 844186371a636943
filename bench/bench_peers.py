"""Benchmark 4, peers end to end: one workload through rabbit-retry, Dramatiq and FastStream.

Every tenth message fails once and is retried after one delay (1 s):

- ours: ``rabbit-retry worker bench.consumers:Peer`` on a one-tier topology;
- Dramatiq: its RabbitMQ broker and Retries middleware; the actor raises
  ``dramatiq.Retry(delay=1000)`` so its delay equals the others' (no jitter);
- FastStream: ``AckPolicy.REJECT_ON_ERROR`` and a TTL queue declared by hand.

Two phases per run, each with a fresh consumer process and vhost:

- throughput: a backlog of N persistent messages is published, then the consumer drains it;
  the figure is N over first delivery to N-th success (so it ends with the last retries' 1 s
  wait, the same for every peer);
- latency: the consumer runs while M messages are published at a steady rate well below every
  peer's capacity; each body carries its publish time and the handler records publish to
  completion of the successful attempt. p50 is the cost of one pass; p99 falls among the
  retried tenth, so it shows how close to the 1 s delay a retry comes back.

Every peer uses classic queues (Dramatiq declares only classic ones) and the same prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from support.amqp import blocking
from support.provision import provision_sync

from bench import common
from bench.baseline_aiopika import declare_retry_by_hand
from bench.baseline_dramatiq import declare_queues, encode
from bench.probe import QUEUE, message_body
from rabbit_retry.settings import Settings
from rabbit_retry.topology.durations import parse_duration

OURS = "rabbit-retry worker"
DRAMATIQ = "Dramatiq"
FASTSTREAM = "FastStream"


def run(
    settings: Settings,
    *,
    n: int = 10_000,
    paced_n: int = 5_000,
    rate: float = 500.0,
    runs: int = 3,
    prefetch: int = 50,
    fail_every: int = 10,
    delay: str = "1s",
    queue_type: str = "classic",
    threads: int = 8,
    timeout: float = 300.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    delay_ms = parse_duration(delay)
    topology = common.queue_topology(QUEUE, delays=[delay], max_attempts=3, queue_type=queue_type)

    def flagged(i: int) -> bool:
        return i % fail_every == 0

    def ours_argv(s: Settings, workdir: Path) -> list[str]:
        path = common.write_topology(workdir, topology)
        return common.rabbit_retry_cli(
            "--url", s.url, "worker", "bench.consumers:Peer", "-t", str(path)
        )

    def dramatiq_argv(s: Settings, _: Path) -> list[str]:
        return common.python_module(
            "bench.baseline_dramatiq",
            *("--url", s.url, "--queue", QUEUE, "--prefetch", str(prefetch)),
            *("--threads", str(threads), "--backoff-ms", str(delay_ms), "--exact-delay"),
        )

    def faststream_argv(s: Settings, _: Path) -> list[str]:
        return common.python_module(
            "bench.baseline_faststream",
            *("--url", s.url, "--queue", QUEUE, "--prefetch", str(prefetch)),
            *("--delay-ms", str(delay_ms), "--queue-type", queue_type),
        )

    peers: dict[str, dict[str, Any]] = {
        OURS: {
            "argv": ours_argv,
            "setup": lambda s: provision_sync(s, topology),
            "make": lambda i: common.json_message(message_body(i, flagged(i)), message_id=str(i)),
            "env": {"BENCH_PREFETCH": str(prefetch)},
        },
        DRAMATIQ: {
            "argv": dramatiq_argv,
            "setup": lambda s: declare_queues(s.url, QUEUE),
            "make": lambda i: common.persistent(encode(QUEUE, message_body(i, flagged(i)))),
            "env": None,
        },
        FASTSTREAM: {
            "argv": faststream_argv,
            # FastStream declares its queues when it starts: the backlog needs them first.
            "setup": lambda s: blocking(
                declare_retry_by_hand(s.url, QUEUE, delay_ms, queue_type), timeout=None
            ),
            "make": lambda i: common.json_message(message_body(i, flagged(i))),
            "env": None,
        },
    }

    def measure(name: str) -> tuple[common.Drain, common.Drain]:
        peer = peers[name]
        tag = "peers-" + name.split()[0].lower()
        drain = common.measure_drain(
            settings, tag, n=n, queue=QUEUE, fail="flagged", timeout=timeout, **peer
        )
        paced = common.measure_drain(
            settings,
            tag,
            n=paced_n,
            queue=QUEUE,
            fail="flagged",
            timeout=timeout,
            publish_first=False,
            rate=rate,
            **peer,
        )
        return drain, paced

    names = [DRAMATIQ, FASTSTREAM]
    notes = [
        f"Throughput: a backlog of {n:,} persistent messages, every {fail_every}th failing once "
        f"and retried after {delay}. Latency: {paced_n:,} messages published at {rate:,.0f}/s "
        f"to a running consumer, same failures. {queue_type} queues; prefetch {prefetch}; "
        f"Dramatiq with {threads} worker threads; median of {runs} alternating runs.",
        "Our worker retries through a confirmed publish to the tier on classic queues (and by "
        "nack only on quorum queues with one tier); FastStream and Dramatiq do not confirm.",
    ]
    names = [OURS, *names]
    log(f"peers: {n:,} + {paced_n:,} paced messages x {runs} runs")
    results: dict[str, list[tuple[common.Drain, common.Drain]]] = {name: [] for name in names}
    for round_, name in common.rotations(runs, names):
        drain, paced = common.measure_once_more(partial(measure, name), what=name, log=log)
        results[name].append((drain, paced))
        lat = paced.probe["latencies"]
        log(
            f"  run {round_ + 1}/{runs} {name}: {drain.rate:,.0f} msg/s; at {rate:,.0f}/s p50 "
            f"{common.percentile(lat, 50) * 1000:.0f} ms, p99 "
            f"{common.percentile(lat, 99) * 1000:.0f} ms"
        )
    params = {"n": n, "paced_n": paced_n, "rate": rate, "runs": runs, "prefetch": prefetch}
    return _result(
        results,
        notes,
        {**params, "fail_every": fail_every, "delay": delay, "queue_type": queue_type},
    )


def _result(
    results: dict[str, list[tuple[common.Drain, common.Drain]]],
    notes: list[str],
    params: dict[str, Any],
) -> dict[str, Any]:
    rates = {name: [d.rate for d, _ in runs] for name, runs in results.items()}

    def latency(name: str, q: float) -> float:
        return common.median(
            [common.percentile(p.probe["latencies"], q) * 1000 for _, p in results[name]]
        )

    p50 = {name: latency(name, 50) for name in results}
    p99 = {name: latency(name, 99) for name in results}
    medians = {name: common.median(values) for name, values in rates.items()}
    rows = []
    for name in results:
        versus = (
            f"{common.ratio(medians[OURS], medians[name]):.2f}"
            if OURS in medians and name != OURS
            else "-"
        )
        rows.append(
            [
                name,
                f"{medians[name]:,.0f}",
                versus,
                f"{p50[name]:,.1f}",
                f"{p99[name]:,.0f}",
                ", ".join(f"{v:,.0f}" for v in rates[name]),
            ]
        )
    headline: dict[str, Any] = {}
    if OURS in medians:
        for name in results:
            if name != OURS:
                headline[f"throughput ours / {name}"] = round(
                    common.ratio(medians[OURS], medians[name]), 3
                )
    return common.result(
        "Peers end to end: 10% of messages fail once",
        [
            "system",
            "median msg/s (backlog)",
            "ours / this",
            "p50 latency (ms, paced)",
            "p99 latency (ms, paced)",
            "each run (msg/s)",
        ],
        rows,
        headline=headline,
        notes=notes,
        params=params,
        plots=[
            common.bars("Peers: throughput draining a backlog", "msg/s", rates),
            common.grouped_bars(
                "Peers: latency, publish to completion, at a steady rate",
                "ms",
                ["p50", "p99"],
                {name: [p50[name], p99[name]] for name in results},
            ),
        ],
    )
