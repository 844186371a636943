"""What an operator does at the desk beyond replay and discard, against the real broker and the
real worker: what became of a replay (succeeded, parked again, pending) and each message's
history across parks and replays; restore; edit and replay; a long replay's progress and its
cancel; notes; grouping rules; groups paged. Every count is checked against the broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pamqp import commands as spec
from support.amqp import depth, drain, publish
from support.desk import ACCESS, access_of, desk_running
from support.parked import Parked, park
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running

from rabbit_retry import Delivery, Permanent, RetryConsumer
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.store import Store
from rabbit_retry.settings import Settings

Q = "orders"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    queue_type: classic
    retry: {{delays: [200ms], max_attempts: 2}}
  {Q}-manual:
    queue_type: classic
"""


class Picky(RetryConsumer):
    """Refuses (``Permanent``) every message whose id is in ``refused``; handles the rest."""

    queue = Q
    prefetch = 50

    def __init__(self, refused: set[str | None]) -> None:
        self.refused = refused
        self.handled: list[str | None] = []

    async def handle(self, delivery: Delivery) -> None:
        if delivery.message_id in self.refused or "*" in self.refused:
            raise Permanent(f"order {delivery.message_id} declined")
        self.handled.append(delivery.message_id)


@contextlib.asynccontextmanager
async def desk(settings: Settings, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The topology applied and a desk whose client is ana (an operator)."""
    topo = topology(TOPOLOGY)
    await provision(settings, topo)
    async with desk_running(topo, settings, f"sqlite:///{tmp_path / 'd.db'}",
                            access=access_of(ACCESS, tmp_path), as_user="ana") as client:
        yield client


async def _count(client: httpx.AsyncClient, **params: Any) -> int:
    return int((await client.get("/api/messages", params={**params, "limit": 1})).json()["total"])


async def _stored(client: httpx.AsyncClient, n: int, **params: Any) -> bool:
    return await _count(client, **params) == n


async def _audit(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    return list((await client.get("/api/audit")).json())


async def test_parks_of_one_message_id_are_each_a_row_of_its_history(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    """Issue 29's collision: each message published twice with the same id and body to a
    handler raising Permanent parks twice, alike to the byte but for its parked-id; the desk
    stores every parked copy exactly once, the two linked in the message's history."""
    async with desk(fresh_vhost, tmp_path) as client:
        consumer = Picky({"*"})
        async with running([consumer], topology(TOPOLOGY), fresh_vhost):
            for i in range(20):
                for _ in range(2):
                    await publish(fresh_vhost, b'{"order": %d}' % i, routing_key=Q,
                                  message_id=f"twice-{i}", correlation_id=f"corr-{i}")
            await eventually(lambda: _stored(client, 40, status="parked"), within=60,
                             what="40 parked copies stored")
        page = (await client.get("/api/messages", params={"limit": 100})).json()
        ids = sorted(m["message_id"] for m in page["items"])
        assert ids == sorted([f"twice-{i}" for i in range(20)] * 2)
        assert len({m["headers"]["parked-id"] for m in page["items"]}) == 40
        first = next(m for m in page["items"] if m["message_id"] == "twice-7")
        assert first["correlation_id"] == "corr-7" and not first["message_id_generated"]
        history = (await client.get(f"/api/messages/{first['id']}/history")).json()
        assert [e["event"] for e in history["events"]] == ["parked", "parked"]
        assert len({e["row"] for e in history["events"]}) == 2


async def test_a_message_without_an_id_is_replayed_under_one_marked_generated(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    """Every AMQP client we test with gives a message an id; a parked copy without one (a
    publisher that sets none, parked by an older worker) is stored as the desk found it."""
    async with desk(fresh_vhost, tmp_path) as client:
        store = Store(f"sqlite:///{tmp_path / 'd.db'}")
        store.insert([parked(Q, b"{}", spec.Basic.Properties(
            correlation_id="task-7", headers={"parked-reason": "exhausted", "parked-id": "p"}),
            now=datetime.now(UTC))])
        store.close()
        [row] = (await client.get("/api/messages")).json()["items"]
        assert (row["message_id"], row["message_id_generated"], row["correlation_id"]) == (
            None, False, "task-7")
        assert (await client.post("/api/replay", json={"ids": [row["id"]]})).json()["replayed"] == 1
        [copy] = await drain(fresh_vhost, Q)
        headers = copy.properties.headers
        assert copy.message_id.startswith("rr-") and headers["message-id-generated"] is True
        assert copy.properties.correlation_id == "task-7"
        # It fails again and parks under its made-up id: still the same message's history.
        await park(fresh_vhost, Q, [Parked(b"{}", message_id=copy.message_id, headers={
            "replay-id": headers["replay-id"], "message-id-generated": True})])
        await eventually(lambda: _stored(client, 1, status="parked"), what="parked again")
        [again] = (await client.get("/api/messages", params={"status": "parked"})).json()[
            "items"]
        assert again["message_id_generated"] is True
        history = (await client.get(f"/api/messages/{row['id']}/history")).json()
        assert [(e["event"], e["row"], e.get("then")) for e in history["events"]] == [
            ("parked", row["id"], None), ("replayed", row["id"], "parked again"),
            ("parked", again["id"], None)]


async def test_what_became_of_a_replay_and_each_message_s_history(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    declined = {f"o-{i}" for i in range(0, 30, 3)}  # 10 of 30 still fail after the replay
    async with desk(fresh_vhost, tmp_path) as client:
        consumer = Picky({"*"})
        async with running([consumer], topology(TOPOLOGY), fresh_vhost):
            for i in range(30):
                await publish(fresh_vhost, b"{}", routing_key=Q, message_id=f"o-{i}")
            await eventually(lambda: _stored(client, 30, status="parked"), within=60,
                             what="30 parked")
            [group] = (await client.get("/api/groups")).json()
            consumer.refused = declined  # the cause is fixed, for 20 of them
            replayed = (await client.post("/api/replay", json={"group": group["id"]})).json()
            replay_id = replayed["replay_id"]
            assert (replayed["replayed"], replayed["state"]) == (30, "done")
            await eventually(lambda: _stored(client, 10, status="parked"), within=60,
                             what="10 parked again")
            await eventually(lambda: len(consumer.handled) == 20, what="20 handled")

        async def results() -> dict[str, Any]:
            entry = (await client.get(f"/api/replays/{replay_id}")).json()
            return dict(entry["results"])

        await eventually(lambda: _pending_none(results), within=60, what="nothing pending")
        assert await results() == {"sent": 30, "parked_again": 10, "pending": 0,
                                   "succeeded": 20}
        entry = (await client.get(f"/api/replays/{replay_id}")).json()
        assert entry["progress"] == {"total": 30, "done": 30, "refused": 0, "left": 0,
                                     "rate": entry["progress"]["rate"], "eta_s": 0}
        again = (await client.get("/api/messages", params={"status": "parked"})).json()
        assert sorted(m["message_id"] for m in again["items"]) == sorted(declined)
        assert {m["replay_of"] for m in again["items"]} == {replay_id}

        # One declined message's history: parked, replayed by ana, parked again as a new row.
        back = next(m for m in again["items"] if m["message_id"] == "o-3")
        history = (await client.get(f"/api/messages/{back['id']}/history")).json()
        events = [(e["event"], e.get("actor"), e.get("then")) for e in history["events"]]
        assert events == [("parked", None, None), ("replayed", "ana", "parked again"),
                          ("parked", None, None)]
        assert history["events"][1]["next_row"] == back["id"]
        assert history["events"][2]["replay_of"] == replay_id
        # A handled one's: parked, replayed, and it succeeded (nothing can still be pending).
        ok = (await client.get("/api/messages", params={"q": "o-4", "status": "replayed"}))
        history = (await client.get(f"/api/messages/{ok.json()['items'][0]['id']}/history")
                   ).json()
        assert [(e["event"], e.get("then")) for e in history["events"]] == [
            ("parked", None), ("replayed", "succeeded")]


async def _pending_none(results: Any) -> bool:
    return bool((await results())["pending"] == 0)


async def test_a_discarded_message_is_restored_and_replayed(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        await park(fresh_vhost, Q, [Parked(b'{"n": %d}' % i, message_id=f"d-{i}")
                                    for i in range(3)])
        await eventually(lambda: _stored(client, 3, status="parked"), what="3 parked")
        ids = sorted(m["id"] for m in (await client.get("/api/messages")).json()["items"])
        await client.post("/api/discard", json={"ids": ids, "reason": "looked like junk"})
        assert await _stored(client, 3, status="discarded")
        nothing = await client.post("/api/restore", json={"ids": [12345]})
        assert (nothing.status_code, nothing.json()) == (404, {"error": "no message 12345"})
        restored = await client.post("/api/restore", json={"ids": ids[:2], "reason": "they were"})
        assert restored.json() == {"restored": 2}
        assert await _stored(client, 2, status="parked")
        again = await client.post("/api/restore", json={"ids": ids[:2]})
        assert (again.status_code, again.json()["error"]) == (
            409, "nothing to restore: none of the 2 messages is discarded (2 are parked)")
        done = (await client.post("/api/replay", json={"ids": ids[:2]})).json()
        assert done["replayed"] == 2
        assert sorted(c.message_id for c in await drain(fresh_vhost, Q)) == ["d-0", "d-1"]
        history = (await client.get(f"/api/messages/{ids[0]}/history")).json()
        assert [(e["event"], e.get("actor"), e["reason"] if e["event"] != "replayed" else None)
                for e in history["events"]] == [
            ("parked", None, "exhausted"), ("discarded", "ana", "looked like junk"),
            ("restored", "ana", "they were"), ("replayed", "ana", None)]
        assert [(a["action"], a["count"]) for a in await _audit(client)] == [
            ("replay", 2), ("restore", 2), ("discard", 3)]


async def test_edit_and_replay_keeps_the_original_and_records_the_change(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        await park(fresh_vhost, Q, [Parked(b'{"sku": "old", "qty": 1}', message_id="e-1",
                                           headers={"tenant": "acme", "n": 5}),
                                    Parked(b"{}", message_id="e-2")])
        await eventually(lambda: _stored(client, 2, status="parked"), what="2 parked")
        [row] = (await client.get("/api/messages", params={"q": "e-1"})).json()["items"]
        shown = (await client.get(f"/api/messages/{row['id']}")).json()
        editable = shown["editable_headers"]
        assert "retry-count" not in editable and editable["tenant"] == "acme"
        path = f"/api/messages/{row['id']}/edit"

        # What cannot be an edit is refused in one line, and nothing is written.
        for body, status, says in (
            ({}, 400, "nothing changed: edit the body or a header (or replay it as it is)"),
            ({"headers": {**editable, "retry-count": 0}}, 400,
             "headers: 'retry-count' is set by rabbit-retry and a replay removes it; it cannot "
             "be edited"),
            ({"body_base64": "***"}, 400, '"body_base64": not base64'),
            ({"body": "x", "to": "nowhere"}, 400, "\"to\": 'nowhere' is not a queue of the "
             "topology (one of: orders, orders-manual)"),
        ):
            refused = await client.post(path, json=body)
            assert (refused.status_code, refused.json()) == (status, {"error": says}), body
        missing = await client.post("/api/messages/999/edit", json={"body": "x"})
        assert (missing.status_code, missing.json()) == (404, {"error": "no message 999"})
        assert await _audit(client) == []

        edited = await client.post(path, json={
            "body": '{"sku": "new", "qty": 1}', "headers": {**editable, "tenant": "acme-eu"},
            "to": f"{Q}-manual", "reason": "sku renamed"})
        assert edited.status_code == 200, edited.text
        result = edited.json()
        assert (result["replayed"], result["state"]) == (1, "done")
        [copy] = await drain(fresh_vhost, f"{Q}-manual")
        headers = copy.properties.headers
        assert copy.body == b'{"sku": "new", "qty": 1}' and copy.message_id == "e-1"
        assert (headers["tenant"], headers["n"], headers["replay-edited"],
                headers["replay-id"]) == ("acme-eu", 5, True, result["replay_id"])
        assert "parked-reason" not in headers and "retry-count" not in headers
        # The stored message is kept as it was; its status says it was replayed.
        kept = (await client.get(f"/api/messages/{row['id']}")).json()
        assert (kept["body"], kept["headers"]["tenant"], kept["status"]) == (
            '{"sku": "old", "qty": 1}', "acme", "replayed")
        [entry] = await _audit(client)
        assert (entry["actor"], entry["action"], entry["reason"], entry["to_queue"]) == (
            "ana", "edit", "sku renamed", f"{Q}-manual")
        assert entry["detail"]["headers"] == [{"name": "tenant", "before": "acme",
                                               "after": "acme-eu"}]
        assert entry["detail"]["body"].splitlines()[-2:] == ['-{"sku": "old", "qty": 1}',
                                                             '+{"sku": "new", "qty": 1}']
        again = await client.post(path, json={"body": "x"})
        assert (again.status_code, again.json()["error"]) == (
            409, f"nothing to edit: message {row['id']} is replayed, not parked")


async def test_a_long_replay_shows_its_progress_and_can_be_cancelled(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    n = 600
    async with desk(fresh_vhost, tmp_path) as client:
        await park(fresh_vhost, Q, [Parked(b"{}", message_id=f"l-{i}") for i in range(n)])
        await eventually(lambda: _stored(client, n, status="parked"), within=60,
                         what=f"{n} parked")
        [group] = (await client.get("/api/groups")).json()
        started = await client.post("/api/replay", json={"group": group["id"], "rate": 50,
                                                         "wait": 0})
        assert started.status_code == 202
        replay_id = started.json()["replay_id"]
        assert started.json()["progress"]["total"] == n

        async def done() -> int:
            entry = (await client.get(f"/api/replays/{replay_id}")).json()
            assert entry["state"] == "running"
            return int(entry["progress"]["done"])

        await eventually(lambda: _at_least(done, 20), within=60, what="20 replayed")
        entry = (await client.get(f"/api/replays/{replay_id}")).json()
        assert entry["progress"]["rate"] > 0 and entry["progress"]["eta_s"] > 0
        cancel = await client.post(f"/api/replays/{replay_id}/cancel", json={})
        assert cancel.json() == {"cancelling": replay_id}

        async def ended() -> bool:
            return bool((await client.get(f"/api/replays/{replay_id}")).json()["state"]
                        == "cancelled")

        await eventually(ended, within=60, what="the replay cancelled")
        entry = (await client.get(f"/api/replays/{replay_id}")).json()
        replayed = entry["progress"]["done"]
        assert entry["cancelled_by"] == "ana" and 20 <= replayed < n
        # Counted three ways, one number: the audit, the rows, the copies on the broker.
        assert await _count(client, status="replayed") == replayed
        assert await _count(client, status="parked") == n - replayed
        assert await depth(fresh_vhost, Q) == replayed
        late = await client.post(f"/api/replays/{replay_id}/cancel", json={})
        assert (late.status_code, late.json()) == (
            409, {"error": f"replay {replay_id} is not running (it is cancelled)"})


async def _at_least(read: Any, n: int) -> bool:
    return bool(await read() >= n)


async def test_notes_rules_and_groups_paged(fresh_vhost: Settings, tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        await park(fresh_vhost, Q, [
            Parked(b"{}", message_id=f"t-{i}", exception_type="QuotaError",
                   headers={"exception-message": f"tenant {name} over quota"})
            for i, name in enumerate(["acme", "zeta", "omni", "acme"])])
        await eventually(lambda: _stored(client, 4, status="parked"), what="4 parked")
        groups = await client.get("/api/groups", params={"limit": 2})
        assert groups.headers["x-total-count"] == "3" and len(groups.json()) == 2
        assert [g["count"] for g in groups.json()] == [2, 1]

        # A rule names the tenant: one group, once the stored messages are regrouped.
        bad = await client.post("/api/rules", json={"pattern": "(", "name": "tenant"})
        assert (bad.status_code, bad.json()) == (
            400, {"error": "pattern: not a regular expression: missing ), unterminated "
                           "subpattern"})
        rule = (await client.post("/api/rules", json={"pattern": r"tenant \w+",
                                                      "name": "tenant"})).json()

        async def one_group() -> bool:
            return (await client.get("/api/groups")).headers["x-total-count"] == "1"

        await eventually(one_group, within=30, what="one group")
        [group] = (await client.get("/api/groups")).json()
        assert (group["exception_message"], group["count"]) == ("<tenant> over quota", 4)
        filtered = await client.get("/api/groups", params={"q": "over quota"})
        assert filtered.headers["x-total-count"] == "1"
        assert (await client.get("/api/groups", params={"q": "nothing like it"})
                ).headers["x-total-count"] == "0"

        # Notes on the group, by whom and when.
        await client.post(f"/api/groups/{group['id']}/notes", json={"text": "billing knows"})
        empty = await client.post(f"/api/groups/{group['id']}/notes", json={"text": "  "})
        assert (empty.status_code, empty.json()) == (400, {"error": '"text": an empty note'})
        unknown = await client.post("/api/groups/0123456789abcdef/notes", json={"text": "x"})
        assert (unknown.status_code, unknown.json()) == (
            404, {"error": "no group 0123456789abcdef"})
        shown = (await client.get(f"/api/groups/{group['id']}")).json()
        assert [(n["actor"], n["text"]) for n in shown["notes"]] == [("ana", "billing knows")]
        assert shown["counts"] == {"parked": 4}
        assert (await client.get("/api/groups")).json()[0]["notes"] == 1

        # Removing the rule splits them again.
        assert (await client.delete(f"/api/rules/{rule['id']}")).json() == {
            "removed": rule["id"]}
        await eventually(lambda: _groups_are(client, 3), within=30, what="three groups again")
        actions = [(a["action"], a["actor"]) for a in await _audit(client)]
        assert actions == [("rule", "ana"), ("rule", "ana")]


async def _groups_are(client: httpx.AsyncClient, n: int) -> bool:
    return (await client.get("/api/groups")).headers["x-total-count"] == str(n)


@pytest.mark.parametrize("n", [1000])
async def test_a_thousand_sku_key_errors_parked_by_the_worker_are_one_group(
    fresh_vhost: Settings, tmp_path: Path, n: int
) -> None:
    """The issue's case through the real worker: KeyError('sku-...') a thousand times."""

    class Stock(RetryConsumer):
        queue = Q
        prefetch = 100
        permanent_errors = (KeyError,)

        async def handle(self, delivery: Delivery) -> None:
            raise KeyError(f"sku-AB{int(delivery.message_id or 0):05d}")

    async with desk(fresh_vhost, tmp_path) as client:
        async with running([Stock()], topology(TOPOLOGY), fresh_vhost):
            await asyncio.gather(*(publish(fresh_vhost, b"{}", routing_key=Q,
                                           message_id=str(i)) for i in range(n)))
            await eventually(lambda: _stored(client, n, status="parked"), within=120,
                             what=f"{n} parked")
        groups = await client.get("/api/groups")
        assert groups.headers["x-total-count"] == "1"
        assert [(g["exception_type"], g["exception_message"], g["count"])
                for g in groups.json()] == [("KeyError", "'sku-<id>'", n)]


async def test_discarding_the_parked_holder_of_an_ordered_key_lets_the_key_go_on(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    """A parked copy that holds its ordered key (``ordered-hold``): discarded at the desk, its
    key's lane gets the release, through the main queue as a replay would go (README, ordered
    keys: a discarded holder must not hold its key for ever); a copy that holds nothing sends
    nothing (the control)."""
    async with desk(fresh_vhost, tmp_path) as client:
        await park(fresh_vhost, Q, [
            Parked(b"{}", message_id="holder", headers={"ordered-key": "user-7",
                                                        "ordered-hold": "hold-42"}),
            Parked(b"{}", message_id="plain")])
        await eventually(lambda: _stored(client, 2, status="parked"), what="2 parked")
        ids = {m["message_id"]: m["id"] for m in
               (await client.get("/api/messages")).json()["items"]}
        done = await client.post("/api/discard", json={"ids": [ids["plain"]], "reason": "x"})
        assert done.json() == {"discarded": 1}
        assert await depth(fresh_vhost, Q) == 0  # nothing to release
        done = await client.post("/api/discard", json={"ids": [ids["holder"]], "reason": "x"})
        assert done.json() == {"discarded": 1}
        [release] = await drain(fresh_vhost, Q)
        headers = release.properties.headers
        assert release.body == b""
        assert (headers["ordered-release"], headers["ordered-key"]) == ("hold-42", "user-7")
        assert "parked-reason" not in headers and "ordered-hold" in headers
