"""Benchmark 3, a retry storm: N messages all fail into a long (60 s) delay. Where do they wait?

Ours: ``rabbit-retry worker bench.consumers:AlwaysFail`` on a one-tier topology: each failure is
a nack and the broker keeps the message in ``Q.retry.60s``. Dramatiq: an actor that always
raises, Retries middleware with ``min_backoff`` = the delay: each failure publishes a copy to
``Q.DQ``, and the worker's delay-queue consumer (prefetch 1000 x threads) pulls those copies
back and holds them, unacked, in memory until their eta (see ``bench/baseline_dramatiq.py``).

Each worker runs as its own process; its RSS is sampled every 50 ms from before the first
publish until every message has failed once and the broker's view has settled, which all
happens well before the delay ends (so no message comes back during the measurement). The
broker-side view comes from the management API: where the N messages are, ready or unacked.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.amqp import publish_stream_sync
from support.provision import provision_sync

from bench import common
from bench.baseline_dramatiq import encode
from bench.probe import QUEUE, message_body
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming
from rabbit_retry.topology.durations import parse_duration

MB = 1024 * 1024
OURS = "rabbit-retry worker"
DRAMATIQ = "Dramatiq"


def run(
    settings: Settings,
    *,
    n: int = 20_000,
    runs: int = 3,
    prefetch: int = 50,
    queue_type: str = "classic",
    delay: str = "60s",
    threads: int = 8,
    settle: float = 20.0,
    idle: float = 1.0,
    timeout: float = 240.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    common.compile_like_an_install()  # memory is compared with an installed Dramatiq
    delay_ms = parse_duration(delay)
    tier = naming.tier_queue(QUEUE, delay_ms)
    topology = common.queue_topology(QUEUE, delays=[delay], max_attempts=2, queue_type=queue_type)

    def ours() -> dict[str, Any]:
        def argv(s: Settings, workdir: Path) -> list[str]:
            path = common.write_topology(workdir, topology)
            return common.rabbit_retry_cli(
                "--url", s.url, "worker", "bench.consumers:AlwaysFail", "-t", str(path)
            )

        return storm(
            settings,
            "storm-ours",
            setup=lambda s: provision_sync(s, topology),
            argv=argv,
            make=lambda i: common.json_message(message_body(i), message_id=str(i)),
            holding=[tier],
            env={"BENCH_PREFETCH": str(prefetch)},
            n=n,
            settle=settle,
            idle=idle,
            timeout=timeout,
        )

    def dramatiq() -> dict[str, Any]:
        def argv(s: Settings, _: Path) -> list[str]:
            return common.python_module(
                "bench.baseline_dramatiq",
                "--url",
                s.url,
                "--queue",
                QUEUE,
                "--prefetch",
                str(prefetch),
                "--threads",
                str(threads),
                "--backoff-ms",
                str(delay_ms),
                # Retries' own default ceiling (7 days): the first backoff is 1-2 x min_backoff.
                "--max-backoff-ms",
                str(7 * 86_400_000),
            )

        return storm(
            settings,
            "storm-dramatiq",
            setup=lambda s: None,
            argv=argv,
            make=lambda i: common.persistent(encode(QUEUE, message_body(i))),
            holding=[QUEUE + ".DQ"],
            env=None,
            n=n,
            settle=settle,
            idle=idle,
            timeout=timeout,
        )

    systems: dict[str, Callable[[], dict[str, Any]]] = {DRAMATIQ: dramatiq}
    notes = [
        f"{n:,} persistent messages published to a running worker; every attempt fails; delay "
        f"{delay}; prefetch {prefetch}; {queue_type} queues (Dramatiq declares classic queues); "
        f"Dramatiq with {threads} worker threads in one process; median of {runs} alternating "
        "runs (peak RSS), RSS plot from the last run.",
        "Idle = RSS after the worker connected, before the first publish. Broker view = where "
        "the messages are once every one of them failed once (management API).",
        "How each one waits. Ours: the worker nacks, the broker dead-letters the message into "
        f"`{tier}` (x-message-ttl {delay_ms} ms), nothing stays in the worker. Dramatiq "
        "(`brokers/rabbitmq.py`, `middleware/retries.py`, `worker.py`): Retries publishes a copy "
        f"with an eta to `{QUEUE}.DQ` (no TTL); the worker consumes `{QUEUE}.DQ` with a "
        f"prefetch of 1000 x threads ({1000 * threads:,} here) and holds those copies, unacked, "
        "in an in-process priority queue until the eta passes, then re-publishes them to "
        f"`{QUEUE}`; the rest wait ready in `{QUEUE}.DQ`. First backoff: min_backoff x 1-2 "
        "(jitter), so 60-120 s here.",
    ]
    systems = {OURS: ours, **systems}
    log(f"retry storm: {n:,} messages x {runs} runs")
    outcomes: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for round_, name in common.rotations(runs, list(systems)):
        outcome = common.measure_once_more(systems[name], what=name, log=log)
        outcomes[name].append(outcome)
        log(
            f"  run {round_ + 1}/{runs} {name}: peak {outcome['peak'] / MB:.1f} MB, "
            f"idle {outcome['idle'] / MB:.1f} MB, broker {outcome['broker']}"
        )
    params = {"n": n, "runs": runs, "prefetch": prefetch, "queue_type": queue_type}
    return _result(outcomes, notes, params={**params, "delay": delay, "threads": threads})


def storm(
    base: Settings,
    tag: str,
    *,
    setup: Callable[[Settings], object],
    argv: Callable[[Settings, Path], list[str]],
    make: Callable[[int], Any],
    holding: list[str],
    env: dict[str, str] | None,
    n: int,
    settle: float,
    idle: float,
    timeout: float,
) -> dict[str, Any]:
    """One storm against one worker process; RSS sampled throughout (``idle`` seconds before
    the first publish, and as long again after the broker's view settled)."""
    with (
        common.throwaway_vhost(base, tag) as settings,
        tempfile.TemporaryDirectory(prefix="rr-bench-") as tmp,
    ):
        workdir = Path(tmp)
        setup(settings)
        with common.consumer_process(
            argv(settings, workdir), n=n, fail="always", env=env, workdir=workdir
        ) as consumer:
            common.wait_for_consumer(settings, QUEUE, 60, consumer.proc, consumer.log)
            sampler = common.RssSampler(consumer.proc.pid).start()
            try:
                time.sleep(idle)
                idle_rss = sampler.rss_now()
                start = time.time()
                publish_stream_sync(settings, QUEUE, n, make)
                probe = consumer.result(timeout)
                failed_in = float(probe["last"]) - start
                view = _settled_view(settings, holding, n, settle)
                # Dramatiq's delay consumer keeps pulling after the view settles: a last look.
                time.sleep(idle)
            finally:
                sampler.stop()
            elapsed = time.time() - start
    rss = sampler.points
    return {
        "idle": idle_rss,
        "peak": sampler.peak,
        "failed_in": failed_in,
        "elapsed": elapsed,
        "broker": view,
        "series": [(t, r / MB) for t, r in rss],
        "failures": probe["failures"],
    }


def _settled_view(
    settings: Settings, holding: list[str], n: int, settle: float
) -> dict[str, dict[str, int]]:
    """The management API's view once the held queues account for all N messages (its counts
    lag by a statistics interval), or whatever it shows when ``settle`` seconds have passed."""
    deadline = time.monotonic() + settle
    while True:
        view = common.broker_queues(settings)
        held = sum(view.get(q, {}).get("total", 0) for q in holding)
        if held >= n or time.monotonic() > deadline:
            return view
        time.sleep(1.0)


def _result(
    outcomes: dict[str, list[dict[str, Any]]], notes: list[str], params: dict[str, Any]
) -> dict[str, Any]:
    rows = []
    peaks: dict[str, float] = {}
    series: dict[str, list[tuple[float, float]]] = {}
    for name, runs in outcomes.items():
        peak = common.median([r["peak"] / MB for r in runs])
        idle = common.median([r["idle"] / MB for r in runs])
        peaks[name] = peak
        last = runs[-1]
        view = last["broker"]
        ready = sum(q["ready"] for q in view.values())
        unacked = sum(q["unacked"] for q in view.values())
        where = "; ".join(
            f"`{q}` {c['ready']:,} ready / {c['unacked']:,} unacked"
            for q, c in sorted(view.items())
            if c["total"]
        )
        rows.append(
            [
                name,
                f"{idle:.1f}",
                f"{peak:.1f}",
                f"{peak - idle:+.1f}",
                f"{ready:,}",
                f"{unacked:,}",
                f"{common.median([r['failed_in'] for r in runs]):.1f}",
                where or "(empty)",
            ]
        )
        series[name] = last["series"]
    headline: dict[str, Any] = {}
    if OURS in peaks and DRAMATIQ in peaks:
        growth = {
            name: common.median([(r["peak"] - r["idle"]) / MB for r in runs])
            for name, runs in outcomes.items()
        }
        headline = {
            "peak RSS ours / Dramatiq": round(common.ratio(peaks[OURS], peaks[DRAMATIQ]), 3),
            "RSS growth ours (MB)": round(growth[OURS], 1),
            "RSS growth Dramatiq (MB)": round(growth[DRAMATIQ], 1),
        }
    return common.result(
        "Retry storm: every message fails into a 60 s delay",
        [
            "worker",
            "idle RSS (MB)",
            "peak RSS (MB)",
            "growth (MB)",
            "broker: ready",
            "broker: unacked (held by the worker)",
            "all failed after (s)",
            "where the messages wait (last run)",
        ],
        rows,
        headline=headline,
        notes=notes,
        params=params,
        plots=[
            common.lines("Worker RSS during a retry storm", "seconds", "RSS (MB)", series),
        ],
    )
