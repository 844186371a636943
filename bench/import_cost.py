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

# Each layer adds to the ones before it, in the order the worker loads them.
LAYERS = (
    ("python", ""),
    ("asyncio", "import asyncio"),
    ("aiormq + aio-pika", "import aiormq, aio_pika"),
    ("pydantic (topology model)", "from pydantic import BaseModel"),
    ("prometheus-client", "import prometheus_client"),
    ("click, ruamel.yaml, tenacity", "import click, ruamel.yaml, tenacity"),
    ("rabbit_retry worker path (models, runner)",
     "import rabbit_retry.cli, rabbit_retry.cli.worker, rabbit_retry.topology,"
     " rabbit_retry.worker.runner"),
)
PEER = ("Dramatiq (its worker's imports)", "import dramatiq, dramatiq.brokers.rabbitmq")

PROBE = "{code}\nprint(int(open('/proc/self/statm').read().split()[1]) * 4096)"


def rss_after(code: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    code = ""
    previous = 0.0
    print(f"{'after importing':<42} {'RSS MB':>7} {'added':>7}")
    for name, line in LAYERS:
        code = f"{code}\n{line}"
        mb = statistics.median(rss_after(code) for _ in range(args.runs)) / 1e6
        print(f"{name:<42} {mb:7.1f} {mb - previous if previous else 0:+7.1f}")
        previous = mb
    try:
        peer = statistics.median(rss_after(PEER[1]) for _ in range(args.runs)) / 1e6
        print(f"{PEER[0]:<42} {peer:7.1f}")
    except subprocess.CalledProcessError:
        print(f"{PEER[0]}: not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
