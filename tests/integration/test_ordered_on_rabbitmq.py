"""An ordered queue on the real broker: apply creates it (a second apply has nothing to do),
status counts its held keys, and two workers in this process apply each user's events in order
through a retry, a parked message replayed and one purged (its key released)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from support.amqp import Outgoing, depth, publish_raw
from support.broker import enable_plugin
from support.poll import eventually
from support.process import Ran, cli
from support.provision import topology
from support.worker import running

from rabbit_retry import Delivery, Permanent, RetryConsumer
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "rewards.points"
TOPOLOGY = f"""\
version: 1
exchanges:
  rewards: {{type: topic}}
queues:
  {Q}:
    queue_type: QTYPE
    bindings: [{{exchange: rewards, routing_key: "points.*"}}]
    ordered: {{key: {{header: user-id}}, lanes: 3}}
    retry: {{delays: [200ms], max_attempts: 3}}
"""


class Ledger(RetryConsumer):
    queue = Q
    prefetch = 5

    def __init__(self, applied: dict[str, list[int]], plan: dict[tuple[str, int], Any]) -> None:
        self.applied = applied
        self.plan = plan

    async def handle(self, delivery: Delivery) -> None:
        user, seq = delivery.headers["user-id"], delivery.payload["seq"]
        step = self.plan.get((user, seq), 0)
        if step == "park":
            raise Permanent(f"{user}/{seq}: not yet")
        if step and delivery.attempt <= step:
            raise RuntimeError("busy")
        self.applied[user].append(seq)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_apply_status_and_two_workers_keep_each_keys_order(
    fresh_vhost: Settings, management: Management, tmp_path: Path, queue_type: str,
) -> None:
    async def run_cli(*args: str) -> Ran:  # in a thread: the workers run on this loop
        return await asyncio.to_thread(cli, fresh_vhost, *args)

    enable_plugin(management, "x-consistent-hash", "rabbitmq_consistent_hash_exchange")
    file = tmp_path / "rewards.yml"
    file.write_text(TOPOLOGY.replace("QTYPE", queue_type))
    assert (await run_cli("apply", str(file))).code == 0
    again = await run_cli("apply", str(file))
    assert "nothing to do" in again.out, again.out + again.err
    applied: dict[str, list[int]] = defaultdict(list)
    plan: dict[tuple[str, int], Any] = {("ann", 2): 1, ("ben", 3): "park", ("cat", 1): "park"}
    topo = topology(file.read_text())
    users = ("ann", "ben", "cat", "dee")
    async with running([Ledger(applied, plan)], topo, fresh_vhost), \
            running([Ledger(applied, plan)], topo, fresh_vhost):
        await publish_raw(fresh_vhost, [
            Outgoing(f"{u}-{s}", json.dumps({"seq": s}).encode(), {"user-id": u}).wire()
            for s in range(1, 6) for u in users], exchange="rewards", routing_key="points.x")
        await eventually(lambda: len(applied["ann"]) == 5 and len(applied["dee"]) == 5,
                         what="ann (through a retry) and dee done")
        async def both_parked() -> bool:
            return await depth(fresh_vhost, f"{Q}.parking") == 2

        await eventually(both_parked, what="ben's and cat's parked")
        status = json.loads((await run_cli("status", str(file), "--json")).out)["queues"][0]
        assert status["held_keys"] == 2  # ben and cat, each held by its parked message
        assert status["held_messages"] >= 2 + 2 + 4  # ben 4-5, cat 2-5, and their holds
        assert applied["ben"] == [1, 2] and applied["cat"] == []
        plan[("ben", 3)] = 0  # fixed: replay ben's
        done = await run_cli("parking", "replay", Q, "--where", "ordered-key=ben", "--yes")
        assert done.code == 0, done.err
        done = await run_cli("parking", "purge", Q, "--yes")  # cat's: dropped
        assert done.code == 0, done.err
        await eventually(lambda: len(applied["ben"]) == 5 and len(applied["cat"]) == 4,
                         what="ben and cat finished")
    assert dict(applied) == {"ann": [1, 2, 3, 4, 5], "ben": [1, 2, 3, 4, 5],
                             "cat": [2, 3, 4, 5], "dee": [1, 2, 3, 4, 5]}
