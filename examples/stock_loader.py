"""A batch consumer (README, "Batch handlers"): stock movements stored in SQLite up to 500 at a
time, one transaction per batch; a movement for an unknown SKU is parked on its own while the
rest of its batch is stored.

    rabbit-retry apply topologies/warehouse.yml
    rabbit-retry worker examples.stock_loader:LoadMovements -t topologies/warehouse.yml
"""

from __future__ import annotations

import sqlite3

from pydantic import BaseModel

from rabbit_retry import Batch, BatchResult, Delivery, Permanent, RetryConsumer


class Movement(BaseModel):
    movement_id: str
    sku: str
    quantity: int


class UnknownSku(Permanent):
    """Parks the movement: no retry will make the SKU known."""


class LoadMovements(RetryConsumer[Movement]):
    queue = "warehouse.movements"
    batch = Batch(size=500, wait=0.2)  # up to 500 movements, or what came within 0.2 s

    def __init__(self, database: str = "warehouse.db") -> None:
        self.database = database

    async def on_start(self) -> None:
        self.db = sqlite3.connect(self.database)
        self.db.executescript(
            "create table if not exists skus (sku text primary key);"
            "create table if not exists movements"
            " (movement_id text primary key, sku text, quantity integer);"
        )

    async def on_stop(self) -> None:
        self.db.close()

    async def handle_batch(self, deliveries: list[Delivery[Movement]]) -> BatchResult | None:
        skus = sorted({d.payload.sku for d in deliveries})
        marks = ",".join("?" * len(skus))
        known = {sku for (sku,) in self.db.execute(
            f"select sku from skus where sku in ({marks})", skus)}
        failed: dict[Delivery[Movement], BaseException] = {
            d: UnknownSku(f"unknown sku {d.payload.sku!r}")
            for d in deliveries if d.payload.sku not in known
        }
        with self.db:  # one transaction; raising here retries the whole batch
            self.db.executemany(
                "insert or ignore into movements values (?, ?, ?)",  # a redelivery is harmless
                [(d.payload.movement_id, d.payload.sku, d.payload.quantity)
                 for d in deliveries if d not in failed],
            )
        return BatchResult(failed=failed)
