"""The three-node cluster of scripts/cluster.sh, for the tests that need one (test-only, shared
with bench/): which node leads a queue, killing and restarting a node as a crashed machine goes,
and a node list tried from another node.

``eval "$(scripts/cluster.sh env)"`` exports ``RABBIT_RETRY_TEST_CLUSTER`` (the script) and
``RABBIT_RETRY_TEST_CLUSTER_NODES`` besides the URL lists; scripts/test.sh does it for CI.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest

from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings


def starting_at(settings: Settings, index: int) -> Settings:
    """The same nodes, tried from the ``index``-th (0-based) on, wrapping round: workers given
    the same list spread over the cluster this way."""
    urls = settings.urls[index % len(settings.urls):] + settings.urls[: index % len(settings.urls)]
    return replace(settings, url=urls[0], more_urls=urls[1:])


HOW = 'scripts/cluster.sh up && eval "$(scripts/cluster.sh env)"; scripts/test.sh does both'


@dataclass(frozen=True)
class Cluster:
    script: str
    nodes: tuple[str, ...]  # c1@localhost, ... in the order of the URL lists

    def number(self, node: str) -> int:
        """1, 2 or 3: the node's place in the URL lists (and its number for the script)."""
        return self.nodes.index(node) + 1

    def kill(self, node: str) -> None:
        """``kill -9`` of the node's VM: no goodbye to anyone."""
        self._run("kill", str(self.number(node)))

    def start(self, node: str) -> None:
        """Start a killed node again; it rejoins with its data (returns once it answers)."""
        self._run("start", str(self.number(node)))

    @contextmanager
    def down(self, node: str) -> Iterator[None]:
        """The node killed for the block, started again after it, however the block ends (the
        next test needs every node)."""
        self.kill(node)
        try:
            yield
        finally:
            self.start(node)

    def queues(self, node: str, *args: str) -> str:
        """``rabbitmq-queues ARGS`` aimed at ``node``; its output."""
        return self._run("queues", str(self.number(node)), *args)

    def _run(self, *args: str) -> str:
        done = subprocess.run([self.script, *args], capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{self.script} {' '.join(args)}: {done.stderr.strip()}"
        return done.stdout


def cluster_or_skip(api: Management) -> Cluster:
    """The cluster under test, or a skip saying how to bring it up."""
    script = os.environ.get("RABBIT_RETRY_TEST_CLUSTER")
    nodes = tuple(n for n in os.environ.get("RABBIT_RETRY_TEST_CLUSTER_NODES", "").split(",") if n)
    if not script or len(nodes) < 3:
        pytest.skip(f"needs the three-node cluster ({HOW})")
    try:
        running = {n["name"] for n in api.get("/nodes") if n.get("running")}
    except BrokerError as exc:
        pytest.skip(f"the cluster does not answer ({exc}); {HOW}")
    if not set(nodes) <= running:
        pytest.skip(f"not every node of the cluster runs (running: {sorted(running)}); {HOW}")
    return Cluster(script, nodes)


def leader(api: Management, vhost: str, queue: str) -> str:
    """The node that leads a quorum queue (4.x ``leader``; the queue's ``node`` otherwise)."""
    info = api.queue(vhost, queue)
    assert info is not None, queue
    return str(info.get("leader") or info["node"])
