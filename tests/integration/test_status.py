"""``rabbit-retry status FILE`` on the real broker: the counts match what each queue holds, and
a missing tier or parking queue is drift, listed first, with exit code 1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aio_pika
import pytest
from support.amqp import on_channel, publish
from support.broker import version
from support.parked import Parked, park
from support.provision import provision
from support.stranding import return_until_dead_lettered, stuck_topology

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

TOPOLOGY = """
version: 1
exchanges: {orders: {type: topic}}
queues:
  orders:
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [1h, 2h], max_attempts: 3}
  payments:
    queue_type: classic
    retry: {delays: [1h], max_attempts: 2}
"""
# Management statistics are refreshed every few seconds: wait for them, generously.
DEADLINE_S = 90.0
Run = Callable[..., Any]


class Holder:
    """A consumer that holds ``prefetch`` messages of ``queue`` unacknowledged until closed."""

    def __init__(self, settings: Settings, queue: str, prefetch: int) -> None:
        self._args = (settings, queue, prefetch)
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        settings, queue, prefetch = self._args
        connection = await aio_pika.connect(settings.url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            q = await channel.get_queue(queue, ensure=False)

            async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                pass  # never acked: unacked until the connection closes

            await q.consume(hold)
            self._started.set()
            await asyncio.to_thread(self._stop.wait)

    def __enter__(self) -> Holder:
        self._thread.start()
        assert self._started.wait(30), "consumer did not start"
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)


async def declare_old_tier(settings: Settings, name: str, ttl_ms: int, main: str) -> None:
    """A tier left behind by an earlier delay of ``main``: still draining, so still counted."""
    await on_channel(settings, lambda ch: ch.queue_declare(name, durable=True, arguments={
        "x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish", "x-message-ttl": ttl_ms,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": main}))


@pytest.fixture
def topology(tmp_path: Path) -> Path:
    path = tmp_path / "orders.yml"
    path.write_text(TOPOLOGY, encoding="utf-8")
    return path


def status_json(run_cli: Run, settings: Settings, path: Path) -> tuple[int, dict[str, Any]]:
    result = run_cli("status", str(path), "--json", settings=settings)
    assert result.code in (0, 1), result.err
    return result.code, json.loads(result.out)


def test_status_counts_what_each_queue_holds(
    fresh_vhost: Settings, run_cli: Run, topology: Path
) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(declare_old_tier(fresh_vhost, "orders.retry.5m", 300_000, "orders"))
    asyncio.run(publish(fresh_vhost, b"o", routing_key="orders", count=6))
    asyncio.run(publish(fresh_vhost, b"t1", routing_key="orders.retry.1h", count=3))
    asyncio.run(publish(fresh_vhost, b"t2", routing_key="orders.retry.2h"))
    asyncio.run(publish(fresh_vhost, b"old", routing_key="orders.retry.5m", count=2))
    asyncio.run(park(fresh_vhost, "orders", [Parked(b"p")] * 5))
    asyncio.run(publish(fresh_vhost, b"pay", routing_key="payments"))
    asyncio.run(park(fresh_vhost, "payments", [Parked(b"pp")] * 2))
    expected = [
        {"queue": "orders", "ready": 4, "unacked": 2, "consumers": 1, "retrying": 6,
         "parked": 5,
         "tiers": {"orders.retry.1h": 3, "orders.retry.2h": 1, "orders.retry.5m": 2},
         "held_for_dead_lettering": {}, "stranded_by_dead_letter_cycle": {}},
        {"queue": "payments", "ready": 1, "unacked": 0, "consumers": 0, "retrying": 0,
         "parked": 2, "tiers": {"payments.retry.1h": 0}, "held_for_dead_lettering": {},
         "stranded_by_dead_letter_cycle": {}},
    ]
    with Holder(fresh_vhost, "orders", prefetch=2):
        deadline = time.monotonic() + DEADLINE_S
        while True:
            code, data = status_json(run_cli, fresh_vhost, topology)
            replicas = [q.pop("replicas") for q in data["queues"]]
            policies = [q.pop("policy") for q in data["queues"]]
            if data["queues"] == expected or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert data["queues"] == expected
        assert (code, data["ok"], data["drift"], data["vhost"], data["file"]) == (
            0, True, [], fresh_vhost.vhost, str(topology))
        # One node: each quorum queue (orders, its tiers and parking queue; payments is classic)
        # has one replica, its leader, online; nothing to warn about.
        assert [[r["queue"] for r in q] for q in replicas] == [
            ["orders", "orders.retry.1h", "orders.retry.2h", "orders.parking"], []]
        for r in replicas[0]:
            assert r["members"] == r["online"] == [r["leader"]] and r["warning"] is None
        assert data["warnings"] == []
        assert [(p["name"], p["ours"], p["operator_policy"]) for p in policies] == [
            (None, None, None), (None, None, None)]  # no policy on this vhost

        result = run_cli("status", str(topology), settings=fresh_vhost)
    assert result.code == 0, result.err
    rows = {line.split("│")[0].strip(): [c.strip() for c in line.split("│")[1:]]
            for line in result.out.splitlines() if "│" in line}
    assert rows == {"orders": ["4", "2", "1", "6", "5"], "payments": ["1", "0", "0", "0", "2"]}
    assert result.out.rstrip().endswith(f"no drift: the broker has every object {topology} "
                                        "derives")


def test_parked_and_ready_counts_are_exact_at_once(
    fresh_vhost: Settings, run_cli: Run, topology: Path
) -> None:
    """No waiting for the management statistics: a script that alerts on parked messages sees
    them on its first look (the statistics take seconds to show them)."""
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    for round_ in (1, 2):
        asyncio.run(park(fresh_vhost, "orders", [Parked(b"p")] * 7))
        asyncio.run(publish(fresh_vhost, b"o", routing_key="orders", count=3))
        code, data = status_json(run_cli, fresh_vhost, topology)
        orders = data["queues"][0]
        assert (code, orders["queue"], orders["parked"], orders["ready"]) == (
            0, "orders", 7 * round_, 3 * round_)
    assert data["sampled"] == ["unacked", "held_for_dead_lettering", "online"]


def test_a_deleted_tier_and_parking_queue_are_drift_first_and_exit_1(
    fresh_vhost: Settings, run_cli: Run, management: Management, topology: Path
) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    code, data = status_json(run_cli, fresh_vhost, topology)
    assert (code, data["ok"]) == (0, True)
    for queue in ("orders.retry.1h", "orders.parking"):
        path = f"/queues/{quote(fresh_vhost.vhost, safe='')}/{quote(queue, safe='')}"
        assert management.request("DELETE", path).status_code == 204

    result = run_cli("status", str(topology), settings=fresh_vhost)
    assert result.code == 1
    drops = "the broker drops the messages that should go there"
    assert result.out.splitlines()[:5] == [
        f"DRIFT: 4 objects of {topology} missing or different on the broker; `rabbit-retry "
        f"plan {topology}` shows the fix",
        f"  missing queue orders.retry.1h (retry tier of orders): {drops}",
        f"  missing queue orders.parking (parking queue of orders): {drops}",
        f"  missing binding orders.retry -> orders.retry.1h [1h] (retry route of orders): {drops}",
        f"  missing binding orders.retry -> orders.retry.1h [orders] (retry route of orders): "
        f"{drops}",
    ]
    orders_row = next(line for line in result.out.splitlines() if line.startswith("orders "))
    assert orders_row.split("│")[-1].strip() == "-"  # no parking queue: nothing to count

    code, data = status_json(run_cli, fresh_vhost, topology)
    assert (code, data["ok"]) == (1, False)
    assert [(d["kind"], d["name"], d["role"], d["drops_messages"]) for d in data["drift"]] == [
        ("missing", "orders.retry.1h", "tier", True),
        ("missing", "orders.parking", "parking", True),
        ("missing", "orders.retry -> orders.retry.1h [1h]", "retry-binding", True),
        ("missing", "orders.retry -> orders.retry.1h [orders]", "retry-binding", True),
    ]
    assert data["queues"][0]["parked"] is None


def test_status_of_a_bad_file_is_exit_2(fresh_vhost: Settings, run_cli: Run,
                                        tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("version: 1\nqueues: {}\n", encoding="utf-8")
    result = run_cli("status", str(path), settings=fresh_vhost)
    assert result.code == 2
    assert result.err.startswith(f"error: {path}:2: ")


STUCK_TOPOLOGY = stuck_topology(1)


def test_messages_stuck_in_dead_lettering_are_reported(
    fresh_vhost: Settings, run_cli: Run, tmp_path: Path
) -> None:
    # Without a worker, a message returned past the delivery limit goes to the tier, and the
    # tier's way back to "stuck" is a dead-letter cycle the broker refuses: it holds it.
    path = tmp_path / "stuck.yml"
    path.write_text(STUCK_TOPOLOGY, encoding="utf-8")
    asyncio.run(provision(fresh_vhost, STUCK_TOPOLOGY))
    assert asyncio.run(return_until_dead_lettered(fresh_vhost, "stuck")) == 2
    deadline = time.monotonic() + DEADLINE_S
    while True:
        code, data = status_json(run_cli, fresh_vhost, path)
        held = data["queues"][0]["held_for_dead_lettering"]
        if held or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (code, held) == (0, {"stuck.retry.200ms": 1})
    assert data["queues"][0]["stranded_by_dead_letter_cycle"] == {"stuck.retry.200ms": 1}
    result = run_cli("status", str(path), settings=fresh_vhost)
    assert "stuck.retry.200ms: 1 message stranded by RabbitMQ's dead-letter cycle check: they " \
           "reached stuck's delivery limit" in " ".join(result.out.split())


def test_messages_stranded_in_the_main_queue_are_reported_with_their_way_out(
    fresh_vhost: Settings, run_cli: Run, tmp_path: Path, management: Management
) -> None:
    """A message retried once (it has the tier in its x-death) that then reaches the delivery
    limit is stranded in the main queue itself on 4.x (docs/versions.md, "Stranded messages")."""
    if version(management) < (4, 0):
        pytest.skip("3.10 dead-letters it to the tier and back into the queue: nothing held")
    path = tmp_path / "stuck.yml"
    path.write_text(STUCK_TOPOLOGY, encoding="utf-8")
    asyncio.run(provision(fresh_vhost, STUCK_TOPOLOGY))
    asyncio.run(return_until_dead_lettered(fresh_vhost, "stuck", through_the_tier_first=True))
    deadline = time.monotonic() + DEADLINE_S
    while True:
        code, data = status_json(run_cli, fresh_vhost, path)
        row = data["queues"][0]
        if row["held_for_dead_lettering"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (code, row["stranded_by_dead_letter_cycle"]) == (0, {"stuck": 1})
    result = run_cli("status", str(path), settings=fresh_vhost)
    assert "stuck: 1 message stranded by RabbitMQ's dead-letter cycle check" in " ".join(
        result.out.split())
    assert f"`rabbit-retry rescue {path} stuck` parks them" in " ".join(result.out.split())
