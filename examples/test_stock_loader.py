"""``LoadMovements`` (examples/stock_loader.py) on the in-memory broker: one batch, each movement
its own outcome (pytest with pytest-asyncio, from the repository root)."""

import sqlite3
from pathlib import Path

from examples.stock_loader import LoadMovements
from rabbit_retry.testing import TestBroker


async def test_a_batch_stores_the_known_and_parks_the_unknown(tmp_path: Path) -> None:
    database = str(tmp_path / "warehouse.db")
    loader = LoadMovements(database)
    async with TestBroker("topologies/warehouse.yml") as broker, broker.worker(loader):
        loader.db.execute("insert into skus values ('apple'), ('pear')")
        loader.db.commit()
        for i, sku in enumerate(["apple", "pear", "kiwi", "apple"]):
            broker.publish(json={"movement_id": f"m-{i}", "sku": sku, "quantity": i},
                           exchange="warehouse", routing_key="movement", message_id=f"m-{i}")
        decisions = {d.message_id: d for d in await broker.settle()}
    assert [decisions[f"m-{i}"].verdict for i in range(4)] == [
        "acked", "acked", "parked", "acked"]
    assert decisions["m-2"].reason == "permanent"
    assert decisions["m-2"].headers["exception-message"] == "unknown sku 'kiwi'"
    stored = sqlite3.connect(database).execute("select movement_id from movements").fetchall()
    assert sorted(stored) == [("m-0",), ("m-1",), ("m-3",)]
