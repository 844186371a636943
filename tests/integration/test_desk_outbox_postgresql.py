"""The desk's outbox on PostgreSQL (the unit tests run it on SQLite): an application's dead
events listed, shown, retried and discarded through the desk's API, its audit in the desk's own
store, the change in the application's database. No broker: the desk never publishes an event."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from support.outbox import migrated, outbox_store, refused_events, statuses

from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.app import Desk, create_app
from rabbit_retry.desk.serve import open_outbox
from rabbit_retry.desk.store import Store
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
queues:
  shop.orders:
    bindings: [{exchange: shop, routing_key: "order.*"}]
"""


def test_dead_events_in_a_postgresql_outbox_are_listed_retried_and_discarded(
    tmp_path: Path,
) -> None:
    topology = tmp_path / "shop.yml"
    topology.write_text(TOPOLOGY)
    with outbox_store("postgresql", tmp_path) as url:
        migrated(url)
        ids = refused_events(url, topology, dead={
            f"lost-{i}": {"exchange": "shop", "routing_key": "order.lost", "key": "c-1",
                          "body": f'{{"n": {i}}}'} for i in range(3)})
        store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
        store.migrate()
        outbox = open_outbox(url)
        settings = Settings.from_env("amqp://guest:guest@127.0.0.1:1/", None)
        desk = Desk(store, Actions(store, settings, {"shop.orders"}), ["shop.orders"],
                    outbox=outbox)
        try:
            with TestClient(create_app(desk), base_url="http://127.0.0.1") as client:
                listed = client.get("/api/outbox", params={"status": "dead"}).json()
                assert listed["total"] == 3
                assert {e["message_id"] for e in listed["items"]} == set(ids)
                assert client.get("/api/overview").json()["outbox"] == {"dead": 3, "failed": 0}
                one = client.get(f"/api/outbox/{ids['lost-0']}").json()
                assert [h["status"] for h in one["history"]] == ["pending", "failed", "dead"]
                assert client.post("/api/outbox/retry", json={
                    "ids": [ids["lost-0"], ids["lost-1"]]}).json() == {"retried": 2,
                                                                       "skipped": 0}
                assert client.post("/api/outbox/discard", json={
                    "ids": [ids["lost-1"], ids["lost-2"]], "reason": "duplicate"}).json() == {
                    "discarded": 1, "skipped": 1}
                assert client.post("/api/outbox/discard", json={
                    "ids": [ids["lost-2"]], "reason": "again"}).status_code == 409
                audit = client.get("/api/audit").json()
                assert [(e["action"], e["count"]) for e in audit] == [
                    ("outbox-discard", 1), ("outbox-retry", 2)]
        finally:
            outbox.close()
            store.close()
        assert statuses(url) == {"pending": 2, "discarded": 1}
