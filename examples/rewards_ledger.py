"""An ordered consumer (README, "Ordered keys"): a rewards-points ledger. A user's balance depends
on the order of their events (a bonus doubles what is there), so each user's events must be
applied in the order they were published, even when one of them fails and waits for a retry.

    rabbitmq-plugins enable rabbitmq_consistent_hash_exchange
    rabbit-retry apply topologies/rewards.yml
    rabbit-retry worker examples.rewards_ledger:Ledger -t topologies/rewards.yml   # run several
"""

from __future__ import annotations

import sqlite3
from typing import Literal

from pydantic import BaseModel

from rabbit_retry import Delivery, Permanent, RetryConsumer


class PointsEvent(BaseModel):
    event_id: str
    kind: Literal["purchase", "refund", "bonus"]
    points: int = 0  # a purchase earns them, a refund takes them back; a bonus doubles


class Ledger(RetryConsumer[PointsEvent]):
    queue = "rewards.points"  # ordered by header user-id (topologies/rewards.yml)

    def __init__(self, database: str = "ledger.db") -> None:
        self.database = database

    async def on_start(self) -> None:
        self.db = sqlite3.connect(self.database)
        self.db.executescript(
            "create table if not exists balances (user_id text primary key, points integer);"
            "create table if not exists applied (event_id text primary key);"
        )

    async def on_stop(self) -> None:
        self.db.close()

    async def handle(self, delivery: Delivery[PointsEvent]) -> None:
        user, event = delivery.headers["user-id"], delivery.payload
        with self.db:  # one transaction: the event and the balance it changes
            if self.db.execute("select 1 from applied where event_id = ?",
                               (event.event_id,)).fetchone():
                return  # handled before a crash: once is enough
            row = self.db.execute("select points from balances where user_id = ?",
                                  (user,)).fetchone()
            balance = row[0] if row else 0
            if event.kind == "refund" and balance < event.points:
                raise Permanent(f"refund of {event.points} exceeds the balance {balance}")
            balance = {"purchase": balance + event.points, "refund": balance - event.points,
                       "bonus": balance * 2}[event.kind]
            self.db.execute("insert into applied values (?)", (event.event_id,))
            self.db.execute("insert into balances values (?, ?) on conflict (user_id) do "
                            "update set points = excluded.points", (user, balance))
