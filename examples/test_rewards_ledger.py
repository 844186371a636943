"""``Ledger`` (examples/rewards_ledger.py) on the in-memory broker: each user's events applied in
publish order through a retry, other users unaffected (pytest with pytest-asyncio, from the
repository root)."""

import sqlite3
from pathlib import Path

from examples.rewards_ledger import Ledger
from rabbit_retry.testing import TestBroker


class FlakyLedger(Ledger):
    """The ledger's database is busy for alice's first event, once."""

    busy = True

    async def handle(self, delivery):  # type: ignore[no-untyped-def]
        if self.busy and delivery.payload.event_id == "a-1":
            self.busy = False
            raise TimeoutError("database is locked")
        await super().handle(delivery)


async def test_each_users_events_apply_in_order_through_a_retry(tmp_path: Path) -> None:
    database = str(tmp_path / "ledger.db")
    events = [("alice", "a-1", "purchase", 100), ("bob", "b-1", "purchase", 10),
              ("alice", "a-2", "bonus", 0), ("bob", "b-2", "bonus", 0),
              ("alice", "a-3", "refund", 50)]
    async with TestBroker("topologies/rewards.yml") as broker, \
            broker.worker(FlakyLedger(database)):
        for user, event_id, kind, points in events:
            broker.publish(json={"event_id": event_id, "kind": kind, "points": points},
                           exchange="rewards", routing_key="points.earned",
                           headers={"user-id": user}, message_id=event_id)
        first = {d.message_id: d.verdict for d in await broker.settle()}
        assert first == {"a-1": "retried", "a-2": "held", "a-3": "held",
                         "b-1": "acked", "b-2": "acked"}  # bob did not wait for alice
        await broker.settle(retries=True)
    balances = dict(sqlite3.connect(database).execute("select * from balances").fetchall())
    assert balances == {"alice": (100 * 2) - 50, "bob": 10 * 2}
