"""The worker on the three-node 4.3 cluster of scripts/cluster.sh: throughput against one 4.3
node in the same run, and how long consumption pauses when the queue's leader dies.

Throughput: the success path of ``bench_worker`` (N persistent messages in a quorum queue, then
the worker drains them with a no-op handler, timed from the first delivery to the last
completion), on the single 4.3 node of ``scripts/broker.sh`` and on the cluster, runs
alternating with the order rotated each round, medians. On the cluster the queue is declared
over the first node, which then leads it (4.x places a new leader on the declaring
connection's node); the worker is measured on that node and on another one (its deliveries
then come through a second node).

Failover: a quorum queue (quorum parking too) filled with messages, the worker consuming with a
handler that takes ``handler_ms``; after ``before`` messages the node leading the queue is
killed (``kill -9``). The pause is the time from the kill to the first message handled after
the longest gap in handling around it (messages the worker already held, handled just after
the kill, do not count as "consuming again"), timed from just before the kill command. On one
machine a killed node's connections close at once, so its peers see it gone at once; a machine
that vanishes from the network is noticed only after the Erlang distribution's tick timeout
(net_ticktime, 60 s by default), which this does not measure. Trials alternate between the
worker connected to the leader's node (it also loses its connection and reconnects through the
list) and to another node (only the leader changes). The node is started again after each trial.

    python -m bench.bench_cluster [--messages 20000] [--runs 3] [--kills 3]

Skipped, with a note saying how to bring it up, when the cluster or the single 4.3 node does
not answer. Each measurement uses a throwaway vhost (``rr-bench-<BENCH_RUN_ID>-cluster-...``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import subprocess
import time
from typing import Any

from support.amqp import persistent, publish_stream
from support.cluster import starting_at
from support.provision import provision

from bench import common
from bench.bench_worker import Clock, fill, our_worker, topology
from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology, parse_topology
from rabbit_retry.worker import Delivery, RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics

CLUSTER_SH = common.REPO / "scripts" / "cluster.sh"
BROKER_SH = common.REPO / "scripts" / "broker.sh"
HOW = "scripts/cluster.sh up (and scripts/broker.sh up 4.3)"
FAILOVER_QUEUE = "bench.failover"
# How long to wait for consumption to resume after a kill before calling the trial failed: a
# deadline, not an expectation.
RESUME_DEADLINE_S = 180.0
ON_LEADER, ELSEWHERE = "the leader's node", "another node"


def _env_of(script: list[str]) -> dict[str, str]:
    """The ``export`` lines a script prints (``cluster.sh env``, ``broker.sh env 4.3``)."""
    done = subprocess.run(script, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out


def targets() -> tuple[Settings, Settings, tuple[str, ...]] | str:
    """(single 4.3 node, the cluster, its node names), or why they cannot be measured."""
    cluster_env = _env_of([str(CLUSTER_SH), "env"])
    single_env = _env_of([str(BROKER_SH), "env", "4.3"])
    if "RABBIT_RETRY_TEST_URL" not in cluster_env or "RABBIT_RETRY_TEST_URL" not in single_env:
        return f"scripts/cluster.sh env or scripts/broker.sh env 4.3 printed no URL; {HOW}"
    cluster = Settings.from_env(cluster_env["RABBIT_RETRY_TEST_URL"],
                                cluster_env["RABBIT_RETRY_TEST_MANAGEMENT_URL"])
    single = Settings.from_env(single_env["RABBIT_RETRY_TEST_URL"],
                               single_env["RABBIT_RETRY_TEST_MANAGEMENT_URL"])
    nodes = tuple(cluster_env.get("RABBIT_RETRY_TEST_CLUSTER_NODES", "").split(","))
    try:
        with Management(cluster.management_urls, timeout=10) as api:
            running = {n["name"] for n in api.get("/nodes") if n.get("running")}
        with Management(single.management_url, timeout=10) as api:
            version = str(api.overview().get("rabbitmq_version"))
    except BrokerError as exc:
        return f"not measured: {exc}; {HOW}"
    if len(nodes) != 3 or not set(nodes) <= running:
        return f"not measured: the cluster is not up (running: {sorted(running)}); {HOW}"
    if not version.startswith("4.3"):
        return f"not measured: the single node is RabbitMQ {version}, not 4.3"
    return single, cluster, nodes


# --- throughput ----------------------------------------------------------------------------


async def _throughput_once(base: Settings, messages: int, prefetch: int, topo: Topology,
                           worker_at: int) -> Clock:
    with common.throwaway_vhost(base, "cluster") as scoped:
        await provision(scoped, topo)  # over the first node: it leads the queue
        await fill(scoped, messages)
        return await our_worker(starting_at(scoped, worker_at), messages, prefetch, topo)


def throughput(single: Settings, cluster: Settings, messages: int, runs: int, prefetch: int,
               log: Any) -> dict[str, list[float]]:
    topo = topology("quorum")

    def side(base: Settings, worker_at: int) -> Any:
        return lambda: asyncio.run(
            _throughput_once(base, messages, prefetch, topo, worker_at)).rate

    return common.alternate(runs, {
        "one 4.3 node": side(single, 0),
        "cluster, worker on the leader's node": side(cluster, 0),
        "cluster, worker on another node": side(cluster, 1),
    }, log=log)


# --- failover ------------------------------------------------------------------------------


class Timed(RetryConsumer):
    """Notes when each message was handled (monotonic seconds)."""

    queue = FAILOVER_QUEUE

    def __init__(self, handled: list[float], prefetch: int, handler_ms: float) -> None:
        self.handled = handled
        self.prefetch = prefetch
        self.pause_s = handler_ms / 1000

    async def handle(self, delivery: Delivery) -> None:
        await asyncio.sleep(self.pause_s)
        self.handled.append(time.monotonic())


def failover_topology() -> Topology:
    return parse_topology(
        f"""\
version: 1
defaults:
  parking: {{queue_type: quorum}}
queues:
  {FAILOVER_QUEUE}:
    retry: {{delays: [1s], max_attempts: 3}}
""",
        "bench-cluster.yml",
    )


async def _script(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(CLUSTER_SH), *args, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/cluster.sh {' '.join(args)}: {err.decode().strip()}")


def pause_after(handled: list[float], killed_at: float) -> tuple[float, float]:
    """(kill to the first message handled after the longest gap, that gap) in seconds."""
    times = sorted(handled)
    around = [t for t in times if t >= killed_at - 1.0]
    best_gap, resumed = 0.0, killed_at
    for before, after in itertools.pairwise(around):
        if after > killed_at and after - before > best_gap:
            best_gap, resumed = after - before, after
    return resumed - killed_at, best_gap


async def _failover_once(cluster: Settings, nodes: tuple[str, ...], on_leader: bool,
                         messages: int, before: int, prefetch: int, handler_ms: float,
                         log: Any) -> dict[str, Any]:
    topo = failover_topology()
    with common.throwaway_vhost(cluster, "cluster") as scoped:
        await provision(scoped, topo)
        await fill_failover(scoped, messages)
        with Management(scoped.management_urls) as api:
            info = api.queue(scoped.vhost, FAILOVER_QUEUE)
        assert info is not None
        leader = str(info.get("leader") or info["node"])
        index = nodes.index(leader)
        worker_at = index if on_leader else (index + 1) % len(nodes)
        handled: list[float] = []
        runner = Runner([Timed(handled, prefetch, handler_ms)], topology=topo,
                        settings=starting_at(scoped, worker_at), metrics=Metrics())
        task = asyncio.create_task(runner.run())
        try:
            while len(handled) < before:
                if task.done():
                    await task
                    raise RuntimeError("the worker stopped before the kill")
                await asyncio.sleep(0.05)
            # From just before the kill command: the pause is an upper bound by the script's
            # own start (tens of ms), never shortened by its wait for the VM to be gone.
            killed_at = time.monotonic()
            await _script("kill", str(index + 1))
            at_kill = len(handled)
            deadline = killed_at + RESUME_DEADLINE_S
            # Resumed: more handled since the kill than the worker could have held then.
            while len(handled) < at_kill + prefetch + 100:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"consumption did not resume within {RESUME_DEADLINE_S}s")
                await asyncio.sleep(0.05)
            recovered = time.monotonic() - killed_at
            pause, gap = pause_after(handled, killed_at)
        finally:
            runner.stop()
            await _script("start", str(nodes.index(leader) + 1))
            await asyncio.wait_for(task, 120)
    where = ON_LEADER if on_leader else ELSEWHERE
    log(f"  killed {leader} (leader) with the worker on {where}: consuming again after "
        f"{pause:.2f}s (longest gap {gap:.2f}s), {prefetch + 100} more handled after "
        f"{recovered:.2f}s")
    return {"leader": leader, "worker_on": where, "pause_s": pause, "gap_s": gap,
            "recovered_s": recovered}


async def fill_failover(settings: Settings, n: int) -> None:
    body = json.dumps({"order": 1}).encode()
    await publish_stream(settings, FAILOVER_QUEUE, n,
                         lambda i: persistent(body, message_id=f"f-{i}"), window=500)


def failover(cluster: Settings, nodes: tuple[str, ...], kills: int, messages: int, before: int,
             prefetch: int, handler_ms: float, log: Any) -> list[dict[str, Any]]:
    trials = []
    for i in range(kills):
        for on_leader in (True, False) if i % 2 == 0 else (False, True):
            time.sleep(common.PAUSE)
            trials.append(asyncio.run(_failover_once(
                cluster, nodes, on_leader, messages, before, prefetch, handler_ms, log)))
    return trials


# --- the result ----------------------------------------------------------------------------


def run(settings: Settings, **params: Any) -> dict[str, Any]:
    """``run(settings, messages=, runs=, prefetch=, kills=, failover_messages=, before=,
    handler_ms=)``; ``settings`` is not used: the bench measures the 4.3 node and the cluster
    of the scripts, whatever broker the harness was given."""
    log = params.get("log") or common.say
    messages = int(params.get("messages", 20_000))
    runs = int(params.get("runs", 3))
    prefetch = int(params.get("prefetch", 50))
    kills = int(params.get("kills", 3))
    failover_messages = int(params.get("failover_messages", 4_000))
    before = int(params.get("before", 300))
    handler_ms = float(params.get("handler_ms", 20.0))
    settings_used = {"messages": messages, "runs": runs, "prefetch": prefetch, "kills": kills,
                     "failover_messages": failover_messages, "before": before,
                     "handler_ms": handler_ms}
    found = targets()
    if isinstance(found, str):
        log(f"  {found}")
        return common.result(
            "Cluster: throughput against one node, and the pause when a leader dies",
            ["figure", "value"], [["skipped", found]], notes=[found], params=settings_used)
    single, cluster, nodes = found
    rates = throughput(single, cluster, messages, runs, prefetch, log)
    trials = failover(cluster, nodes, kills, failover_messages, before, 10, handler_ms, log)
    one = common.median(rates["one 4.3 node"])
    on_leader = common.median(rates["cluster, worker on the leader's node"])
    elsewhere = common.median(rates["cluster, worker on another node"])
    pauses = {w: [t["pause_s"] for t in trials if t["worker_on"] == w]
              for w in (ON_LEADER, ELSEWHERE)}
    rows = [
        [name, round(common.median(values)), ", ".join(f"{v:.0f}" for v in values)]
        for name, values in rates.items()
    ]
    for w, p in pauses.items():
        recovered = [t["recovered_s"] for t in trials if t["worker_on"] == w]
        rows += [
            [f"pause, worker on {w} (s)", f"{common.median(p):.2f}",
             ", ".join(f"{x:.2f}" for x in p)],
            [f"{10 + 100} more handled, worker on {w} (s)", f"{common.median(recovered):.2f}",
             ", ".join(f"{x:.2f}" for x in recovered)],
        ]
    return common.result(
        "Cluster: throughput against one node, and the pause when a leader dies",
        ["measure", "median", "runs"],
        rows,
        headline={
            "cluster/one node": round(on_leader / one, 3),
            "worker on another node/one node": round(elsewhere / one, 3),
            f"pause (worker on {ON_LEADER})": f"{common.median(pauses[ON_LEADER]):.2f} s",
            f"pause (worker on {ELSEWHERE})": f"{common.median(pauses[ELSEWHERE]):.2f} s",
        },
        notes=[
            f"Throughput: {messages} persistent messages per run in a quorum queue, prefetch "
            f"{prefetch}, no-op handler, {runs} alternating runs per side (order rotated), "
            "median; the single node is scripts/broker.sh's 4.3 node, the cluster three 4.3 "
            "nodes of scripts/cluster.sh on the same machine.",
            f"Failover: {failover_messages} messages, handler {handler_ms:g} ms, prefetch 10; "
            f"the leader killed (kill -9) after {before} handled; pause = kill to the first "
            "message handled after the longest gap in handling, timed from just before the kill "
            "command; then the time until 110 more (the 10 the worker could hold, and 100) "
            f"were handled; the node started again after each trial; {kills} trial(s) per "
            "placement, alternating.",
            "Leaders killed: " + ", ".join(f"{t['leader']} ({t['worker_on']})" for t in trials)
            + ".",
        ],
        params=settings_used,
        samples=rates,
        sample_unit="msg/s",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    result = run(Settings.from_env(os.environ.get("RABBIT_RETRY_URL")),
                 messages=args.messages, runs=args.runs, kills=args.kills)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
