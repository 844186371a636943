"""One command for every benchmark: runs them, then writes docs/benchmarks.md and its plots.

    .venv/bin/python -m bench.run                 # everything, a full run (about 15 minutes)
    .venv/bin/python -m bench.run --only retry,storm --runs 5   # rewrites those two sections
    .venv/bin/python -m bench.run --smoke --out /tmp/b/benchmarks.md   # tiny N: checks the harness

With ``--only``, the report's other sections (their plots, and whatever was written into them
by hand) stay as they are: only the sections and summary rows of the benchmarks run are
replaced, each saying the command, machine and broker it ran with (``splice``).

Each benchmark module offers ``run(settings, **params) -> dict`` (see ``bench/common.py``) and
runs here in a child process of its own with a time budget: a benchmark that hangs is stopped
(SIGTERM first, so its ``finally`` blocks stop its consumers and delete its vhosts) and the
others still run. Every vhost a run makes is named ``rr-bench-<run id>-...``; whatever is left
at the end is deleted and reported. While a benchmark runs, the CPU that other processes on
the machine use (not this run's processes, not the broker) is sampled and written into the
report, so figures taken on a busy machine say so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py` as well as `python -m bench.run`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import bench  # noqa: F401  (puts tests/ on sys.path, for the package support)

import psutil
from support.process import stop
from support.vhosts import TIMEOUT_S as VHOST_TIMEOUT
from support.vhosts import delete_vhost

from bench import common
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings, mask


@dataclass(frozen=True)
class Bench:
    key: str
    module: str
    title: str
    full: Mapping[str, Any]
    smoke: Mapping[str, Any]
    budget: float  # seconds for a full run; a smoke run gets a tenth, at least 60


BENCHES = (
    Bench(
        "worker",
        "bench.bench_worker",
        "Success path: the worker against a bare consume-and-ack loop",
        # bench_worker.py (the worker's own module) names its count ``messages``.
        {"messages": 20_000},
        {"messages": 100, "runs": 1},
        900,
    ),
    Bench(
        "retry",
        "bench.bench_retry",
        "Retry path: fail once, one short tier, then succeed",
        {"n": 10_000, "runs": 5},
        {"n": 100, "runs": 1},
        900,
    ),
    Bench(
        "storm",
        "bench.bench_storm",
        "Retry storm: memory while 20,000 messages wait 60 s",
        {"n": 20_000},
        {"n": 200, "runs": 1, "settle": 0.0, "idle": 0.2},
        900,
    ),
    Bench(
        "peers",
        "bench.bench_peers",
        "Peers end to end: rabbit-retry, Dramatiq, FastStream",
        {"n": 10_000},
        {"n": 100, "paced_n": 50, "runs": 1, "delay": "200ms"},
        900,
    ),
    Bench(
        "apply",
        "bench.bench_apply",
        "apply: a 200-queue topology and its no-op re-run",
        {"queues": 200, "tiers": 3},
        {"queues": 5, "tiers": 3, "runs": 1},
        900,
    ),
    Bench(
        "replay",
        "bench.bench_replay",
        "parking replay: 10,000 messages against a bare confirmed-publish loop",
        {"n": 10_000},
        {"n": 50, "runs": 1},
        900,
    ),
    Bench(
        "desk",
        "bench.bench_desk",
        "Failure desk: ingest, group replay, pages over a million rows",
        {"n": 100_000, "replay_n": 10_000, "rows": 1_000_000, "runs": 3},
        {"n": 200, "replay_n": 100, "rows": 2_000, "runs": 1},
        1800,
    ),
    Bench(
        "outbox",
        "bench.bench_outbox",
        "Outbox: the relay against a bare pipelined confirmed publish, and the cost of add",
        {"n": 20_000, "m": 5_000, "runs": 3},
        {"n": 100, "m": 50, "runs": 1},
        1800,
    ),
    Bench(
        "resilience",
        "bench.bench_resilience",
        "Idempotency stores on the success path, and a Pause's reaction to an outage",
        {"messages": 5_000, "runs": 3},
        {"messages": 100, "runs": 1, "backlog": 300},
        900,
    ),
    Bench(
        "cluster",
        "bench.bench_cluster",
        "Cluster: throughput against one node, and the pause when a leader dies",
        # Not measured (a note says why) when scripts/cluster.sh's cluster is not up.
        {"messages": 20_000, "runs": 3, "kills": 3},
        {"messages": 100, "runs": 1, "kills": 1, "failover_messages": 1_000, "before": 100},
        1800,
    ),
    Bench(
        "ordered",
        "bench.bench_ordered",
        "Ordered keys: 1,000 keys against a plain queue",
        {"n": 20_000, "runs": 3},
        {"n": 500, "runs": 1},
        1200,
    ),
    Bench(
        "batch",
        "bench.bench_batch",
        "Batch handler: rows into PostgreSQL, batch 500 against one at a time",
        {"n": 50_000, "runs": 3},
        {"n": 1_000, "runs": 1},
        1200,
    ),
    Bench(
        "migrate",
        "bench.bench_migrate",
        "migrate: 10,000 messages, classic to quorum, against a bare shovel-style move",
        {"n": 10_000, "runs": 3},
        {"n": 50, "runs": 1},
        900,
    ),
    Bench(
        "tracing",
        "bench.bench_tracing",
        "Traces on the success path: tracing off and on, same run",
        {"messages": 20_000, "runs": 5},
        {"messages": 100, "runs": 1, "cpu_messages": 500},
        900,
    ),
)
PACKAGES = (
    "rabbit-retry",
    "aio-pika",
    "aiormq",
    "pamqp",
    "pydantic",
    "dramatiq",
    "pika",
    "faststream",
    "matplotlib",
    "psutil",
)


# --- one benchmark, in the child process ----------------------------------------------------


def _call(bench: Bench, settings: Settings, params: Mapping[str, Any]) -> dict[str, Any]:
    module = importlib.import_module(bench.module)
    run = module.run
    signature = inspect.signature(run)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    wanted = {"log": common.say, **params}
    # Modules written by others may not take every parameter: pass what they accept.
    accepted = {k: v for k, v in wanted.items() if takes_any or k in signature.parameters}
    outcome = run(settings, **accepted)
    if not isinstance(outcome, dict):
        raise TypeError(f"{bench.module}.run returned {type(outcome).__name__}, not a dict")
    return outcome


def child(bench: Bench, settings: Settings, params: Mapping[str, Any], out: Path) -> int:
    """Runs one benchmark; writes {"result": ...} or {"error": ...} to ``out``."""

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through every finally: consumers, vhosts

    signal.signal(signal.SIGTERM, terminate)
    start = time.monotonic()
    record: dict[str, Any] = {"params": dict(params)}
    try:
        record["result"] = _call(bench, settings, params)
        code = 0
    except ModuleNotFoundError as exc:
        if exc.name != bench.module:
            raise
        record["missing"] = f"`{bench.module.replace('.', '/')}.py` is not in this tree yet"
        code = 0
    except BaseException as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        code = 1
    record["seconds"] = time.monotonic() - start
    out.write_text(json.dumps(record, default=str))
    return code


# --- the parent: budgets, load, leftovers ---------------------------------------------------


class OtherLoad:
    """CPU used by processes outside this run (and outside the broker), in cores, sampled."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._me = os.getpid()

    def __enter__(self) -> OtherLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _ours(self, proc: psutil.Process) -> bool:
        try:
            if proc.pid == self._me or proc.name() == "beam.smp":
                return True
            return any(p.pid == self._me for p in proc.parents())
        except psutil.Error:
            return True

    def _loop(self) -> None:
        cache: dict[int, psutil.Process] = {}
        while not self._stop.wait(self.interval):
            total = 0.0
            seen = set()
            for proc in psutil.process_iter():
                seen.add(proc.pid)
                known = cache.setdefault(proc.pid, proc)
                try:
                    percent = known.cpu_percent(None)
                except psutil.Error:
                    continue
                if percent and not self._ours(known):
                    total += percent
            for pid in set(cache) - seen:
                del cache[pid]
            self.samples.append(total / 100)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def peak(self) -> float:
        return max(self.samples, default=0.0)


@dataclass
class Outcome:
    bench: Bench
    record: dict[str, Any]
    wall: float
    load_mean: float
    load_peak: float
    loadavg: tuple[float, float] = (0.0, 0.0)
    finished: str = ""
    reused: bool = False  # measured by an earlier invocation (--keep)
    images: list[str] = field(default_factory=list)


def parent_run(
    bench: Bench, args: argparse.Namespace, settings: Settings, results: Path
) -> Outcome:
    params = dict(bench.smoke if args.smoke else bench.full)
    if args.runs is not None and not args.smoke:
        params["runs"] = args.runs
    budget = max(60.0, bench.budget / 10) if args.smoke else bench.budget
    out = results / f"{bench.key}.json"
    out.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "bench.run",
        "--child",
        bench.key,
        "--child-out",
        str(out),
        "--child-params",
        json.dumps(params),
        "--url",
        settings.url,
        "--management-url",
        settings.management_url,
    ]
    env = {
        **os.environ,
        # Each child's vhosts are named rr-bench-<run>-<bench>-...: a module that checks for
        # its own leftovers sees only its own, and the final clean-up still sees them all.
        "BENCH_RUN_ID": f"{common.RUN_ID}-{bench.key}",
        **({"BENCH_PAUSE": "0"} if args.smoke else {}),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(common.REPO), os.environ.get("PYTHONPATH")])
        ),
    }
    common.say(f"== {bench.key}: {bench.title} (budget {budget:.0f}s)")
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    with OtherLoad() as load:
        proc = subprocess.Popen(argv, env=env, cwd=str(common.REPO))
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            common.say(f"   {bench.key}: over its {budget:.0f}s budget, stopping it")
        finally:
            stop(proc, grace=60)
    wall = time.monotonic() - start
    if out.exists():
        record = json.loads(out.read_text())
    else:
        record = {"error": f"did not finish within its {budget:.0f}s budget (or crashed)"}
    if "error" in record:
        common.say(f"   {bench.key} failed: {record['error']}")
    outcome = Outcome(
        bench,
        record,
        wall,
        load.mean,
        load.peak,
        (load_before, os.getloadavg()[0]),
        finished=f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
    )
    # Kept with the result, so that a later `--only X --keep` can re-use this section.
    record["run"] = {
        "wall": outcome.wall,
        "load_mean": outcome.load_mean,
        "load_peak": outcome.load_peak,
        "loadavg": list(outcome.loadavg),
        "finished": outcome.finished,
        "smoke": bool(args.smoke),
    }
    out.write_text(json.dumps(record, default=str))
    return outcome


def kept(bench: Bench, results: Path, smoke: bool) -> Outcome | None:
    """The section measured by an earlier invocation, if it succeeded (``--keep``)."""
    path = results / f"{bench.key}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    run = record.get("run")
    if "result" not in record or not run or run.get("smoke") != smoke:
        return None
    return Outcome(
        bench,
        record,
        run["wall"],
        run["load_mean"],
        run["load_peak"],
        tuple(run["loadavg"]),  # type: ignore[arg-type]
        finished=run["finished"],
        reused=True,
    )


# --- the report -----------------------------------------------------------------------------


def machine(settings: Settings) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    broker: dict[str, Any] = {}
    try:
        with Management(settings.management_url) as api:
            overview = api.overview()
        broker = {
            "rabbitmq": overview.get("rabbitmq_version"),
            "erlang": overview.get("erlang_version"),
        }
    except Exception as exc:  # the report still says what it could not learn
        broker = {"error": str(exc)}
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "broker": broker,
        "packages": versions,
    }


def _broker_answers(info: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Every benchmark needs the management API (redrawing the report does not): when it does
    not answer, one line says so."""
    error = info["broker"].get("error") if keys else None
    if error is not None:
        common.say(f"error: {error}; `bash scripts/ensure-broker.sh` starts a local broker with it")
    return error is None


def _plot(spec: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=100)
    data: Mapping[str, Any] = spec["data"]
    kind = spec["kind"]
    if kind == "bars":
        names = list(data)
        medians = [common.median(data[n]) if data[n] else 0.0 for n in names]
        ax.bar(range(len(names)), medians, color="#4C72B0", alpha=0.8)
        for i, name in enumerate(names):
            ax.scatter([i] * len(data[name]), data[name], color="black", s=12, zorder=3)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(spec.get("unit", ""))
    elif kind == "grouped_bars":
        categories = spec["categories"]
        names = list(data)
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs = [i + j * width for i in range(len(categories))]
            ax.bar(xs, data[name], width=width, label=name)
        ax.set_xticks(
            [i + width * (len(names) - 1) / 2 for i in range(len(categories))], categories
        )
        ax.set_ylabel(spec.get("unit", ""))
        ax.legend(fontsize=8)
    elif kind == "lines":
        for name, points in data.items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
        ax.set_xlabel(spec.get("xlabel", ""))
        ax.set_ylabel(spec.get("unit", ""))
        ax.legend(fontsize=8)
    ax.set_title(spec.get("title", ""), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render(
    outcomes: list[Outcome],
    info: Mapping[str, Any],
    args: argparse.Namespace,
    wall: float,
    leftovers: list[str],
    out: Path,
) -> str:
    busy = [o for o in outcomes if o.load_mean >= 0.25]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{args.command}` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; the benchmarks took "
        f"{sum(o.wall for o in outcomes) / 60:.1f} minutes"
        + (
            " (sections marked kept were measured by an earlier invocation: see the time in each). "
            if any(o.reused for o in outcomes)
            else ". "
        )
        + "Every figure is a ratio against a baseline measured in the same run on the same "
        "broker, the two alternating (order rotated each round), medians of the runs; "
        "messages are persistent and the systems compared use the same prefetch. Each "
        "section says how it measures; raw results are in `bench/results/*.json` (not "
        "committed).",
        "",
    ]
    if args.smoke:
        lines += ["**Smoke run: tiny message counts, the figures mean nothing.**", ""]
    if busy:
        lines += [
            "**Taken on a shared machine under load**: while these benchmarks ran, other "
            "processes (not this run, not the broker) used on average up to "
            f"{max(o.load_mean for o in busy):.2f} of the {info['nproc']} cores (see each "
            "section). Ratios hold better than absolute rates, but both are noisy; re-run on an "
            "idle machine for publishable numbers.",
            "",
        ]
    if args.note:
        lines += [args.note, ""]
    broker = info["broker"]
    packages = ", ".join(f"{k} {v}" for k, v in info["packages"].items())
    lines += [
        "## Setup",
        "",
        f"- Machine: {info['cpu']}, {info['nproc']} CPUs (nproc), {info['memory_gb']} GB "
        f"memory, {info['os']}.",
        f"- Broker: RabbitMQ {broker.get('rabbitmq', '?')} on Erlang "
        f"{broker.get('erlang', '?')}, on the same machine (127.0.0.1), default configuration.",
        f"- Python {info['python']}; {packages}.",
        "- Each benchmark's own settings (message count, runs, prefetch, queue type, delays) "
        "are listed in its section.",
        "",
        "## Summary",
        "",
    ]
    summary = []
    for o in outcomes:
        result = o.record.get("result")
        if result is None:
            state = o.record.get("missing") or f"failed: {o.record.get('error')}"
            summary.append([o.bench.title, state, "", ""])
            continue
        headline = result.get("headline") or {}
        figures = "; ".join(f"{k}: {v}" for k, v in headline.items() if k not in ("goal", "met"))
        summary.append(
            [
                result.get("title", o.bench.title),
                figures or "see section",
                result.get("goal") or "",
                headline.get("met") or _met(result.get("goal"), headline.get("ratio")),
            ]
        )
    lines += _table(["benchmark", "figures", "goal", "met"], summary)
    lines.append("")
    for index, o in enumerate(outcomes, 1):
        lines += _section(index, o, out)
    if leftovers:
        lines += [
            "## Clean-up",
            "",
            f"Vhosts this run left behind and deleted at the end: {', '.join(leftovers)}.",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def splice(existing: str, report: str) -> str:
    """``existing`` with the sections and summary rows of ``report`` (a run of some benchmarks,
    ``--only``) in place of theirs, numbered as they were; the other benchmarks' sections, and
    whatever was written into the file by hand, stay as they are. A benchmark the file does not
    have yet is added at the end."""
    parts = [p.rstrip("\n") for p in existing.split("\n## ")]
    fresh = [p.rstrip("\n") for p in report.split("\n## ")]
    titles = {_title(part): i for i, part in enumerate(parts)}
    written = fresh[0].split("\n")[2]  # "Written by `command` on DATE UTC; ..."
    setup = next((p for p in fresh if p.startswith("Setup\n")), "").split("\n")
    where = f"- {written.split(';')[0]}, by itself: " + " ".join(
        line[2:] for line in setup if line.startswith(("- Machine", "- Broker")))
    for part in fresh[1:]:
        title = _title(part)
        if title == "Summary" and "Summary" in titles:
            parts[titles[title]] = _merge_rows(parts[titles[title]], part)
        elif title is None or not part[:1].isdigit():
            continue  # the setup and the rest describe the whole file's run
        elif title in titles:
            number = parts[titles[title]].split(".", 1)[0]
            parts[titles[title]] = _after_settings(number + "." + part.split(".", 1)[1], where)
        else:
            numbered = sum(1 for p in parts if p[:1].isdigit())
            parts.append(_after_settings(f"{numbered + 1}." + part.split(".", 1)[1], where))
            titles[title] = len(parts) - 1
    return "\n\n## ".join(parts) + "\n"


def _after_settings(section: str, line: str) -> str:
    """``line`` added after the section's ``Wall time`` line (a paragraph of its own without
    one)."""
    lines = section.split("\n")
    at = next((i + 1 for i, x in enumerate(lines) if x.startswith(("- Wall time", "Wall time"))),
              None)
    if at is None:
        return "\n".join([*lines, "", line])
    return "\n".join([*lines[:at], line, *lines[at:]])


def _title(part: str) -> str | None:
    """The title of a report's part (``11. Batch handler: ...`` or ``Summary``)."""
    heading = part.split("\n", 1)[0]
    number, dot, title = heading.partition(". ")
    return title if dot and number.isdigit() else heading if heading[:1].isalpha() else None


def _merge_rows(summary: str, fresh: str) -> str:
    """The summary table ``summary`` with the rows of ``fresh`` in place of the rows of the same
    benchmark (a row's first cell, which a hand-written note may follow: ``Title (run ...)``),
    new ones added at its end."""
    lines = summary.split("\n")
    for row in (line for line in fresh.split("\n")[4:] if line.startswith("| ")):
        first = row.split(" | ", 1)[0]
        at = next((i for i, line in enumerate(lines) if line.startswith("| ") and (
            line.split(" | ", 1)[0] == first or line.startswith(first + " ("))), None)
        if at is not None:
            lines[at] = row
        else:
            last = max(i for i, line in enumerate(lines) if line.startswith("|"))
            lines.insert(last + 1, row)
    return "\n".join(lines)


def _fallback_plots(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For a module that returns no plots: bars from a table column listing each run's
    figures ("runs (msg/s)": "3224, 3349, ..."), if it has one."""
    columns = [str(c) for c in result.get("columns") or []]
    index = next((i for i, c in enumerate(columns) if c.lower().startswith("runs")), None)
    if index is None:
        return []
    samples: dict[str, list[float]] = {}
    for row in result.get("rows") or []:
        try:
            samples[str(row[0])] = [float(v.replace(",", "")) for v in str(row[index]).split(", ")]
        except (ValueError, IndexError):
            return []
    unit = columns[index].partition("(")[2].rstrip(")")
    return [common.bars(str(result.get("title", "")), unit, samples)] if samples else []


def _met(goal: Any, ratio: Any) -> str:
    """'yes'/'no' for a goal written ``ratio >= X`` (modules that report only the ratio)."""
    if not isinstance(goal, str) or not isinstance(ratio, int | float):
        return ""
    prefix = "ratio >= "
    if not goal.startswith(prefix):
        return ""
    try:
        return "yes" if ratio >= float(goal[len(prefix) :]) else "no"
    except ValueError:
        return ""


def _section(index: int, o: Outcome, out: Path) -> list[str]:
    record = o.record
    result = record.get("result")
    title = (result or {}).get("title") or o.bench.title
    lines = [f"## {index}. {title}", ""]
    load = (
        f"Wall time {o.wall:.0f} s, finished {o.finished}"
        + (" (kept from an earlier invocation)" if o.reused else "")
        + f"; other processes used {o.load_mean:.2f} cores on average (peak "
        f"{o.load_peak:.2f}); load average {o.loadavg[0]:.2f} before, {o.loadavg[1]:.2f} after."
    )
    if result is None:
        if "missing" in record:
            return [*lines, f"Not measured: {record['missing']}.", ""]
        return [*lines, f"**Failed**: {record.get('error')}", "", load, ""]
    headline = result.get("headline") or {}
    if headline:
        lines += ["**" + "; ".join(f"{k}: {v}" for k, v in headline.items()) + "**", ""]
    if result.get("goal"):
        lines += [f"Goal: {result['goal']}.", ""]
    if result.get("columns"):
        lines += [*_table(result["columns"], result["rows"]), ""]
    else:  # a module that returned a flat mapping of figures
        lines += [*_table(["figure", "value"], [[k, v] for k, v in result.items()]), ""]
    lines += [f"- {note}" for note in result.get("notes", [])]
    params = result.get("params") or record.get("params") or {}
    if params:
        lines.append("- Settings: " + ", ".join(f"`{k}={v}`" for k, v in params.items()) + ".")
    lines += [f"- {load}", ""]
    for i, spec in enumerate(result.get("plots") or _fallback_plots(result)):
        name = f"{out.stem}-{o.bench.key}-{i}.png"
        try:
            _plot(spec, out.parent / name)
        except Exception as exc:  # a plot that cannot be drawn must not cost the report
            lines += [f"(plot {spec.get('title')!r} failed: {exc})", ""]
            continue
        o.images.append(name)
        lines += [f"![{spec.get('title', '')}]({name})", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated keys: " + ",".join(b.key for b in BENCHES))
    parser.add_argument("--runs", type=int, help="runs per system (default: each bench's own)")
    parser.add_argument("--smoke", action="store_true", help="tiny message counts, one run")
    parser.add_argument("--out", default=str(common.REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--results", help="raw JSON directory (default bench/results)")
    parser.add_argument("--note", help="a sentence added to the report (e.g. how busy the box was)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="with --only: the other sections come from the last successful run of each",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the report from the last successful run of each benchmark",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="sample every consumer process with py-spy into DIR and print where time goes",
    )
    parser.add_argument("--url", help="AMQP URL of the broker (its vhost is ignored)")
    parser.add_argument("--management-url", help="management API URL")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-params", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    args.command = mask(" ".join(["python -m bench.run", *map(shlex.quote, raw)]))
    settings = Settings.from_env(args.url, args.management_url)
    by_key = {b.key: b for b in BENCHES}
    if args.child:
        return child(
            by_key[args.child], settings, json.loads(args.child_params), Path(args.child_out)
        )

    keys = args.only.split(",") if args.only else list(by_key)
    if args.render_only:
        keys, args.keep = [], True
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(by_key)}")
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else common.BENCH_DIR / "results"
    results.mkdir(parents=True, exist_ok=True)
    if args.profile:
        os.environ["BENCH_PROFILE_DIR"] = str(Path(args.profile).resolve())
    info = machine(settings)
    if not _broker_answers(info, keys):
        return 2
    start = time.monotonic()
    outcomes = []
    try:
        with _stop_on_sigterm():
            for bench in BENCHES:
                if bench.key in keys:
                    outcomes.append(parent_run(bench, args, settings, results))
                elif args.keep and (earlier := kept(bench, results, args.smoke)) is not None:
                    outcomes.append(earlier)
    finally:
        leftovers = _clean_up(settings)
    wall = time.monotonic() - start
    partial = bool(args.only) and not args.keep and out.exists()
    for key in keys if partial else [""]:  # a partial run redraws only its own plots
        for old in out.parent.glob(f"{out.stem}-{key}{'-' if key else ''}*.png"):
            old.unlink()
    report = render(outcomes, info, args, wall, leftovers, out)
    out.write_text(splice(out.read_text(), report) if partial else report)
    (results / "run.json").write_text(
        json.dumps(
            {
                "machine": info,
                "wall_seconds": wall,
                "benches": {o.bench.key: o.record for o in outcomes},
            },
            default=str,
            indent=1,
        )
    )
    common.say(f"wrote {out} ({wall / 60:.1f} min)")
    if args.profile:
        for path in sorted(Path(args.profile).glob("*.txt")):
            common.say(common.summarize_profile(path))
    failed = [o.bench.key for o in outcomes if "error" in o.record]
    return 1 if failed else 0


def _clean_up(settings: Settings) -> list[str]:
    """Deletes whatever vhost of this run is still on the broker (a child stopped hard, or the
    broker was unreachable when a child tried); returns their names for the report."""
    try:
        leftovers = common.leftover_vhosts(settings)
        if leftovers:
            with Management(settings.management_url, timeout=VHOST_TIMEOUT) as api:
                for name in leftovers:
                    delete_vhost(api, name)
    except Exception as exc:  # the broker is gone: say so, the names are in the log
        common.say(f"warning: could not check for leftover vhosts: {exc}")
        return []
    return leftovers


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM to the parent unwinds it like Ctrl-C: the running child gets stopped in turn."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
