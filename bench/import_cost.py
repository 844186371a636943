"""Where an idle worker's memory goes: the resident size of a fresh interpreter after each layer
of imports a ``rabbit-retry worker`` needs, next to Dramatiq's worker imports, each measured in
a process of its own (RSS from /proc, Linux).

    python -m bench.import_cost [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import compile_like_an_install

TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "orders.yml"

# Each layer adds to the ones before it, in the order the worker loads them.
LAYERS = (
    ("python", ""),
    ("asyncio (it loads ssl, so OpenSSL)", "import asyncio"),
    ("aiormq", "import aiormq"),
    ("click, rabbit_retry.cli and the worker verb", "import rabbit_retry.cli.worker"),
    ("rabbit_retry worker path (runner, session)", "import rabbit_retry.worker.runner"),
    ("the topology, checked in a child process",
     "from rabbit_retry.topology.apart import load_topology_apart\n"
     f"load_topology_apart({str(TOPOLOGY)!r})"),
)
# What the worker path leaves out, each added alone on top of every layer above: when a path
# needs it, it is imported then (and costs this much).
EXTRAS = (
    ("+ pydantic (a consumer with a model)", "import pydantic; pydantic.TypeAdapter(dict)"),
    ("+ the topology checked here (ruamel.yaml, pydantic, schema)",
     "from rabbit_retry.topology import load_topology\n"
     f"load_topology({str(TOPOLOGY)!r})"),
    ("+ prometheus-client (--metrics-port)",
     "from rabbit_retry.worker.metrics import Metrics; Metrics()"),
    ("+ tenacity (a reconnect, a retried publish)", "import tenacity"),
    ("+ aio-pika (not used by the worker)", "import aio_pika"),
)
PEER = ("Dramatiq (its worker's imports)", "import dramatiq, dramatiq.brokers.rabbitmq")

WIDTH = max(len(name) for name, _ in (*LAYERS, *EXTRAS))
PROBE = "{code}\nprint(int(open('/proc/self/statm').read().split()[1]) * 4096)"


def rss_after(code: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    compile_like_an_install()
    code = ""
    previous = 0.0
    print(f"{'after importing':<{WIDTH}} {'RSS MB':>7} {'added':>7}")
    for name, line in LAYERS:
        code = f"{code}\n{line}"
        mb = statistics.median(rss_after(code) for _ in range(args.runs)) / 1e6
        print(f"{name:<{WIDTH}} {mb:7.1f} {mb - previous if previous else 0:+7.1f}")
        previous = mb
    for name, line in EXTRAS:
        mb = statistics.median(rss_after(f"{code}\n{line}") for _ in range(args.runs)) / 1e6
        print(f"{name:<{WIDTH}} {mb:7.1f} {mb - previous:+7.1f}")
    try:
        peer = statistics.median(rss_after(PEER[1]) for _ in range(args.runs)) / 1e6
        print(f"{PEER[0]:<{WIDTH}} {peer:7.1f}")
    except subprocess.CalledProcessError:
        print(f"{PEER[0]}: not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
