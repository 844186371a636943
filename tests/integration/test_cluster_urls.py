"""A list of nodes (``--url a,b,c``): every command and the worker take the next node when one is
down. Runs against any broker: the list's first node is a port nothing listens on, the rest are
the broker under test (one node, or the nodes of the cluster of scripts/cluster.sh)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.amqp import all_empty, publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, RetryConsumer

Q = "cluster.orders"
YAML = f"""\
version: 1
exchanges:
  orders: {{type: topic}}
queues:
  {Q}:
    bindings: [{{exchange: orders, routing_key: order.created}}]
    retry: {{delays: [300ms], max_attempts: 2}}
"""


def with_a_dead_node_first(settings: Settings) -> Settings:
    """``settings`` with a node that is down (nothing listens on port 1) tried first."""
    return replace(
        settings,
        url=f"amqp://guest:secret@127.0.0.1:1/{settings.url.rsplit('/', 1)[1]}",
        more_urls=settings.urls,
        management_url="http://guest:secret@127.0.0.1:1",
        more_management_urls=settings.management_urls,
    )


@pytest.fixture
def topology_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(YAML)
    return path


def test_every_command_takes_the_next_node(
    fresh_vhost: Settings, topology_file: Path, run_cli: Callable[..., Any]
) -> None:
    settings = with_a_dead_node_first(fresh_vhost)
    applied = run_cli("apply", str(topology_file), settings=settings)
    assert applied.code == 0, applied.err
    assert "created" in applied.out
    again = run_cli("plan", str(topology_file), settings=settings)
    assert again.code == 0, again.err
    assert "0 to create" in again.out
    status = run_cli("status", str(topology_file), settings=settings)
    assert status.code == 0, status.err
    assert Q in status.out
    shown = run_cli("parking", "show", Q, settings=settings)
    assert shown.code == 0, shown.err
    assert "secret" not in applied.out + applied.err + status.out + shown.out + shown.err


class Counting(RetryConsumer):
    queue = Q
    prefetch = 10

    def __init__(self) -> None:
        self.ids: list[str | None] = []

    async def handle(self, delivery: Delivery) -> None:
        self.ids.append(delivery.message_id)


async def test_the_worker_takes_the_next_node(fresh_vhost: Settings) -> None:
    settings = with_a_dead_node_first(fresh_vhost)
    topo = topology(YAML)
    await provision(fresh_vhost, topo)
    consumer = Counting()
    async with running([consumer], topo, settings):
        await publish(fresh_vhost, b"{}", exchange="orders", routing_key="order.created", count=20)
        await eventually(lambda: len(consumer.ids) == 20, what="20 handler calls")
        await eventually(lambda: all_empty(fresh_vhost, Q), what="the queue drained")
    assert sorted(consumer.ids) == sorted(f"m-{i}" for i in range(20))


def test_amqp_and_management_on_different_nodes_of_one_cluster(
    fresh_vhost: Settings, topology_file: Path, run_cli: Callable[..., Any],
    management: Management,
) -> None:
    """On RabbitMQ 4.x an unnamed cluster reports each node's own name as the cluster's; AMQP
    on the second node and the management API of the first are still one cluster."""
    if len(fresh_vhost.urls) < 2 or len(management.get("/nodes")) < 2:
        pytest.skip("needs the cluster: eval \"$(scripts/cluster.sh env)\"")
    crossed = replace(fresh_vhost, url=fresh_vhost.urls[1], more_urls=(),
                      management_url=fresh_vhost.management_url, more_management_urls=())
    result = run_cli("apply", str(topology_file), settings=crossed)
    assert result.code == 0, result.err
