"""What the benchmarks share beyond the tests' plumbing (``support``): vhosts named for
the run, consumer subprocesses with RSS sampling, results and plots, and the alternate-then-median
rule every figure follows.

The interface every bench module offers ``bench/run.py``: ``run(settings, **params) -> dict``,
where ``settings`` is a ``rabbit_retry.settings.Settings`` naming the broker (its vhost is
ignored: each measurement makes its own throwaway vhost) and the dict is a ``Result`` (see
``result``) or, failing that, a flat mapping of figure names to values.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aio_pika
import psutil
from support.amqp import blocking, counts, persistent, publish_stream_sync
from support.poll import wait_for
from support.process import CLI, stop
from support.vhosts import throwaway_vhost as named_throwaway_vhost

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


def compile_like_an_install() -> None:
    """Writes the bytecode of this checkout's packages, as pip does when it installs one.

    Run from a checkout with ``PYTHONDONTWRITEBYTECODE=1`` (as CI and these machines set it),
    every start of a worker compiles each of its modules again, and the compiler's leftovers
    stay in the worker's memory (about 2 MB idle); Dramatiq, installed, never pays that."""
    for package in ("rabbit_retry", "bench", "examples", "tests/support"):
        compileall.compile_dir(REPO / package, quiet=1)
PYTHON = sys.executable
# Every vhost this harness makes starts with this, then the run id, so a run deletes only its own.
VHOST_PREFIX = "rr-bench-"
RUN_ID = os.environ.get("BENCH_RUN_ID") or uuid.uuid4().hex[:8]
_counter = iter(range(1_000_000))
T = TypeVar("T")
BROKER_WAIT = 180.0
# Seconds to let the broker settle between measurements and after a backlog is published; a
# smoke run (which measures nothing) sets BENCH_PAUSE=0.
PAUSE = float(os.environ.get("BENCH_PAUSE", "1.0"))


# --- results --------------------------------------------------------------------------------


def result(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    headline: Mapping[str, Any] | None = None,
    goal: str | None = None,
    notes: Sequence[str] = (),
    params: Mapping[str, Any] | None = None,
    plots: Sequence[Mapping[str, Any]] = (),
    samples: Mapping[str, Sequence[float]] | None = None,
    sample_unit: str = "",
) -> dict[str, Any]:
    """The shape run.py renders: a table, headline figures, notes, and plots (``bars``,
    ``grouped_bars``, ``lines``) that run.py draws with matplotlib. ``samples`` (one value per
    run per system) is a shorthand for one ``bars`` plot."""
    if samples:
        plots = [*plots, bars(title, sample_unit, samples)]
    return {
        "title": title,
        "columns": list(columns),
        "rows": [list(r) for r in rows],
        "headline": dict(headline or {}),
        "goal": goal,
        "notes": list(notes),
        "params": dict(params or {}),
        "plots": [dict(p) for p in plots],
    }


def bars(title: str, unit: str, samples: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """One bar per system at its median, each run as a dot."""
    return {
        "kind": "bars",
        "title": title,
        "unit": unit,
        "data": {k: list(v) for k, v in samples.items()},
    }


def grouped_bars(
    title: str, unit: str, categories: Sequence[str], values: Mapping[str, Sequence[float]]
) -> dict[str, Any]:
    """For each category (p50, p99, ...) one bar per system."""
    return {
        "kind": "grouped_bars",
        "title": title,
        "unit": unit,
        "categories": list(categories),
        "data": {k: list(v) for k, v in values.items()},
    }


def lines(
    title: str, xlabel: str, unit: str, series: Mapping[str, Sequence[tuple[float, float]]]
) -> dict[str, Any]:
    """One line per system, (x, y) points."""
    return {
        "kind": "lines",
        "title": title,
        "xlabel": xlabel,
        "unit": unit,
        "data": {k: [list(p) for p in v] for k, v in series.items()},
    }


def throughput_result(
    title: str,
    samples: Mapping[str, Sequence[float]],
    *,
    ours: str,
    baseline: str,
    unit: str,
    goal: float | None,
    notes: Sequence[str],
    params: Mapping[str, Any],
) -> dict[str, Any]:
    """Medians, the ratio ours / baseline (the median of the per-pair ratios, and the ratio of
    the medians), every run, and a bar plot."""
    medians = {name: median(values) for name, values in samples.items()}
    rows = [
        [name, f"{medians[name]:,.0f}", ", ".join(f"{v:,.0f}" for v in values)]
        for name, values in samples.items()
    ]
    headline: dict[str, Any] = {}
    if ours in samples and baseline in samples:
        # Each pair ran back to back, so it shares the machine's mood: the median of the pair
        # ratios is the headline; the ratio of the medians is shown beside it.
        pairs = [ratio(a, b) for a, b in zip(samples[ours], samples[baseline], strict=False)]
        value = median(pairs)
        headline = {"ratio": round(value, 3)}
        if goal is not None:
            headline |= {"goal": f">= {goal}", "met": "yes" if value >= goal else "no"}
        headline["per-run ratios"] = ", ".join(f"{p:.2f}" for p in pairs)
        headline["ratio of medians"] = round(ratio(medians[ours], medians[baseline]), 3)
    return result(
        title,
        ["system", f"median {unit}", f"each run ({unit})"],
        rows,
        headline=headline,
        goal=None if goal is None else f"ratio >= {goal}",
        notes=notes,
        params=params,
        plots=[bars(title, unit, samples)],
    )


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def alternate(
    runs: int,
    systems: Mapping[str, Callable[[], float]],
    *,
    log: Callable[[str], None] | None = None,
    pause: float = PAUSE,
) -> dict[str, list[float]]:
    """Runs every system ``runs`` times, interleaved and with the order rotated each round, so a
    slow minute on a shared machine hurts them all alike; returns the samples per system."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for round_, name in rotations(runs, list(systems), pause=pause):
        value = measure_once_more(systems[name], what=name, log=log)
        samples[name].append(value)
        if log:
            log(f"  run {round_ + 1}/{runs} {name}: {value:,.1f}")
    return samples


def measure_once_more(
    measure: Callable[[], T], *, what: str, log: Callable[[str], None] | None = None
) -> T:
    """``measure()``; if the broker failed under it (other test runs on a shared machine stop
    and start it), waits for the broker and measures once more. A second failure is raised."""
    try:
        return measure()
    except Exception as exc:
        (log or say)(f"  {what}: {type(exc).__name__}: {str(exc)[:200]}; waiting for the broker")
        # Some failures are a broker component restarting (seen: the quorum dead-letter
        # supervisor): give it time even when the management API answers at once.
        time.sleep(15)
        wait_for_broker(BROKER_WAIT)
        return measure()


def wait_for_broker(timeout: float, base: Settings | None = None) -> None:
    """Until the management API answers and a vhost can be made and deleted."""
    base = base or Settings.from_env()
    deadline = time.monotonic() + timeout
    while True:
        try:
            with throwaway_vhost(base, "ping"):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(5)


def rotations(
    runs: int, names: Sequence[str], *, pause: float = PAUSE
) -> Iterator[tuple[int, str]]:
    """(round, system) in the order to measure: interleaved, the order rotated each round."""
    for round_ in range(runs):
        shift = round_ % len(names)
        for name in [*names[shift:], *names[:shift]]:
            # A breath between measurements: the last one's vhost deletion finishes in the
            # broker's background, not in the next measurement.
            time.sleep(pause)
            yield round_, name


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- vhosts ---------------------------------------------------------------------------------


def throwaway_vhost(base: Settings, tag: str) -> contextlib.AbstractContextManager[Settings]:
    """A vhost of this run's own (named for the run, so a run deletes only its own), deleted on
    the way out whatever happened inside."""
    return named_throwaway_vhost(base, f"{VHOST_PREFIX}{RUN_ID}-{tag}-{next(_counter)}")


def leftover_vhosts(base: Settings, run_id: str = RUN_ID) -> list[str]:
    """This run's vhosts still on the broker (should be none once a bench returns)."""
    with Management(base.management_url) as api:
        names = [v["name"] for v in api.get("/vhosts")]
    return [n for n in names if n.startswith(f"{VHOST_PREFIX}{run_id}-")]


# --- messages and waiting -------------------------------------------------------------------
# Publishing, depths, provisioning and polling are the tests' own (support).


def json_message(body: Mapping[str, Any], **kwargs: Any) -> aio_pika.Message:
    return persistent(
        json.dumps(body, separators=(",", ":")).encode(), content_type="application/json", **kwargs
    )


def consumer_gone(proc: subprocess.Popen[bytes], log: Path | None) -> Callable[[], str | None]:
    """For ``wait_for(..., unless=...)``: a consumer that exited ends the wait at once."""

    def reason() -> str | None:
        if proc.poll() is None:
            return None
        return f"consumer exited with {proc.returncode}{_tail(log)}"

    return reason


def wait_for_consumer(
    settings: Settings, queue: str, timeout: float, proc: subprocess.Popen[bytes], log: Path
) -> None:
    def consuming() -> bool:
        state = blocking(counts(settings, queue))
        return state is not None and state[1] > 0

    wait_for(consuming, f"a consumer on {queue}", within=timeout, interval=0.2,
             unless=consumer_gone(proc, log))


def _tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    return ("\n    " + "\n    ".join(text)) if text else ""


def broker_queues(settings: Settings) -> dict[str, dict[str, int]]:
    """The broker-side view of a vhost's queues (management API; lags a stats interval)."""
    with Management(settings.management_url) as api:
        queues = api.queues(settings.vhost)
    return {
        q["name"]: {
            "ready": int(q.get("messages_ready", 0)),
            "unacked": int(q.get("messages_unacknowledged", 0)),
            "total": int(q.get("messages", 0)),
        }
        for q in queues
    }


# --- consumer processes ---------------------------------------------------------------------


@dataclass
class RssSampler:
    """Samples a process's resident set size in a background thread."""

    pid: int
    interval: float = 0.05
    points: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            proc = psutil.Process(self.pid)
            while not self._stop.is_set():
                self.points.append((time.monotonic() - self._t0, proc.memory_info().rss))
                self._stop.wait(self.interval)
        except psutil.Error:
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def now(self) -> float:
        """Seconds since sampling started (the time axis of ``points``)."""
        return time.monotonic() - self._t0

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.points), default=0)

    def rss_now(self) -> int:
        """The RSS read now, between samples: the idle level, read before a publish starts (the
        next sample may come after the first deliveries)."""
        return int(psutil.Process(self.pid).memory_info().rss)


@dataclass
class Consumer:
    """A consumer under test running in its own process, with its probe's result file."""

    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    started: float

    def result(self, timeout: float) -> dict[str, Any]:
        wait_for(self.out.exists, f"result of pid {self.proc.pid}", within=timeout,
                 interval=0.05, unless=consumer_gone(self.proc, self.log))
        data: dict[str, Any] = json.loads(self.out.read_text())
        return data


@contextlib.contextmanager
def consumer_process(
    argv: Sequence[str],
    *,
    n: int,
    fail: str = "none",
    env: Mapping[str, str] | None = None,
    workdir: Path | None = None,
) -> Iterator[Consumer]:
    """Starts a consumer process with its probe configured; always stops it (SIGTERM, then
    SIGKILL after a grace period) on the way out, by its own pid."""
    own_dir = None
    if workdir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="rr-bench-")
        workdir = Path(own_dir.name)
    out = workdir / f"result-{next(_counter)}.json"
    log = workdir / f"consumer-{next(_counter)}.log"
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "BENCH_N": str(n),
        "BENCH_OUT": str(out),
        "BENCH_FAIL": fail,
        **(env or {}),
    }
    with log.open("wb") as log_fh:
        proc = subprocess.Popen(
            list(argv), env=full_env, stdout=log_fh, stderr=subprocess.STDOUT, cwd=str(REPO)
        )
    spy = _attach_profiler(proc.pid, argv)
    try:
        yield Consumer(proc, out, log, time.monotonic())
    finally:
        stop(proc)
        if spy is not None:
            # py-spy writes its profile once the process it watches has exited.
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
        if own_dir is not None:
            own_dir.cleanup()


def _attach_profiler(pid: int, argv: Sequence[str]) -> subprocess.Popen[bytes] | None:
    """With ``BENCH_PROFILE_DIR`` set, py-spy samples every consumer process (collapsed stacks,
    idle time excluded) into that directory, one file per process."""
    directory = os.environ.get("BENCH_PROFILE_DIR")
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    what = next((a for a in argv if ":" in a and "/" not in a), None) or next(
        (a for a in argv if a.startswith("bench.")), "consumer"
    )
    out = Path(directory) / f"{what.replace(':', '.')}-{pid}.txt"
    spy = Path(PYTHON).with_name("py-spy")
    return subprocess.Popen(
        [
            *(str(spy), "record", "--pid", str(pid), "--rate", "250", "--format", "raw"),
            *("--output", str(out), "--nonblocking"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summarize_profile(path: Path, top: int = 25) -> str:
    """Inclusive and self share of samples per function from a py-spy collapsed-stack file."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        # "func (path:line)" -> "func (path)": one entry per function, not per line.
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.name}: {total} samples (busy time only)", "  self%  incl%  function"]
    for frame, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(
            f"  {100 * count / total:5.1f}  {100 * inclusive[frame] / total:5.1f}  {frame}"
        )
    return "\n".join(lines)


def python_module(module: str, *args: str) -> list[str]:
    return [PYTHON, "-m", module, *args]


def rabbit_retry_cli(*args: str) -> list[str]:
    """``rabbit-retry ARGS``: the venv's console script, in a process of its own."""
    return [CLI, *args]


def write_topology(workdir: Path, yaml_text: str) -> Path:
    path = workdir / f"topology-{next(_counter)}.yml"
    path.write_text(yaml_text)
    return path


def queue_topology(queue: str, *, delays: Iterable[str], max_attempts: int, queue_type: str) -> str:
    """A one-queue topology file as a user would write it (no bindings: publish to the queue)."""
    delay_list = ", ".join(delays)
    return (
        "version: 1\n"
        "queues:\n"
        f"  {queue}:\n"
        f"    queue_type: {queue_type}\n"
        f"    retry: {{delays: [{delay_list}], max_attempts: {max_attempts}}}\n"
    )


# --- one measurement ------------------------------------------------------------------------


@dataclass
class Drain:
    """What one consumer did with a backlog: its probe's result and the derived rate."""

    n: int
    probe: dict[str, Any]
    published_at: float
    publish_seconds: float

    @property
    def seconds(self) -> float:
        """First handler call to the N-th completion, as the consumer itself saw them."""
        return float(self.probe["last"] - self.probe["first"])

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else float("nan")

    @property
    def end_to_end_rate(self) -> float:
        """N over first publish to N-th completion (for consumers started before the publish)."""
        span = float(self.probe["last"]) - self.published_at
        return self.n / span if span > 0 else float("nan")


def measure_drain(
    base: Settings,
    tag: str,
    *,
    setup: Callable[[Settings], object],
    argv: Callable[[Settings, Path], list[str]],
    n: int,
    make: Callable[[int], aio_pika.Message],
    queue: str,
    fail: str = "none",
    timeout: float = 300.0,
    publish_first: bool = True,
    settle: float = 2 * PAUSE,
    rate: float | None = None,
    env: Mapping[str, str] | None = None,
    exchange: str = "",
) -> Drain:
    """In a throwaway vhost: ``setup`` declares the queues, the backlog of ``n`` messages is
    published (before the consumer starts, or, with ``publish_first=False``, once it consumes,
    at ``rate`` a second if given; to ``exchange`` with routing key ``queue``, by default
    straight to ``queue``), then the consumer process runs until its probe reports; the vhost
    and process are removed whatever happens."""
    with (
        throwaway_vhost(base, tag) as settings,
        tempfile.TemporaryDirectory(prefix="rr-bench-") as tmp,
    ):
        workdir = Path(tmp)
        setup(settings)
        published_at = time.time()
        publish_seconds = 0.0
        if publish_first:
            publish_seconds = publish_stream_sync(settings, queue, n, make, exchange=exchange)
            # Let the broker finish writing the backlog (quorum WAL, segments) before anyone
            # consumes: otherwise the consumer that starts faster pays for the broker's catch-up.
            time.sleep(settle)
        with consumer_process(
            argv(settings, workdir), n=n, fail=fail, env=env, workdir=workdir
        ) as consumer:
            if not publish_first:
                wait_for_consumer(settings, queue, 60, consumer.proc, consumer.log)
                published_at = time.time()
                publish_seconds = publish_stream_sync(settings, queue, n, make, rate=rate,
                                                      exchange=exchange)
            probe = consumer.result(timeout)
        return Drain(n, probe, published_at, publish_seconds)
