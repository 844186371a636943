"""The failure desk against the real broker and stores: ingest, groups, search, replay,
discard, audit, metrics, and who may do what."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiormq
import httpx
import pytest
from support.amqp import depth, drain
from support.desk import TOKEN, desk_running, store_url
from support.parked import Parked, park
from support.poll import eventually
from support.process import cli
from support.provision import provision, topology

from rabbit_retry.settings import Settings

# orders parks into a quorum queue, audit into a classic one: the desk takes both.
TOPOLOGY = """\
version: 1
queues:
  orders:
    retry: {delays: [1s], max_attempts: 2}
    parking: {queue_type: quorum}
  audit:
    queue_type: classic
"""


def causes(n_timeouts: int, n_missing: int) -> list[Parked]:
    return ([Parked(f'{{"order": {i}}}'.encode(), exception_type="TimeoutError",
                    message_id=f"t-{i}",
                    headers={"exception-message": f"gateway timed out after {i}s"})
             for i in range(n_timeouts)]
            + [Parked(f'{{"order": {i}}}'.encode(), exception_type="KeyError", reason="permanent",
                      message_id=f"k-{i}", headers={"exception-message": f"order {i} not found"})
               for i in range(n_missing)])


@contextlib.asynccontextmanager
async def desk_with(settings: Settings, tmp_path: Path, timeouts: int, missing: int,
                    **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The topology applied, ``timeouts`` + ``missing`` messages parked and a desk (SQLite)
    that has stored them all."""
    topo = topology(TOPOLOGY)
    await provision(settings, topo)
    await park(settings, "orders", causes(timeouts, missing))
    async with desk_running(topo, settings, f"sqlite:///{tmp_path / 'd.db'}",
                            **kwargs) as client:
        await eventually(lambda: _parked_now(client, timeouts + missing),
                         what=f"{timeouts + missing} parked")
        yield client


async def _parked_now(client: Any, n: int) -> bool:
    return bool((await client.get("/api/overview")).json()["parked"] == n)


def _group(groups: list[dict[str, Any]], exception_type: str) -> dict[str, Any]:
    [found] = [g for g in groups if g["exception_type"] == exception_type]
    return found


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{wanted}}} in /metrics")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_parked_messages_are_stored_once_grouped_and_leave_the_parking_queue(
    fresh_vhost: Settings, tmp_path: Path, kind: str
) -> None:
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    await park(fresh_vhost, "orders", causes(120, 80))
    with store_url(kind, tmp_path) as url:
        async with desk_running(topo, fresh_vhost, url) as client:
            await eventually(lambda: _parked_now(client, 200), what="200 parked in the store")
            await eventually(lambda: depth_is(fresh_vhost, "orders.parking", 0),
                             what="the parking queue emptied")
            groups = (await client.get("/api/groups")).json()
            assert sorted((g["exception_type"], g["exception_message"], g["count"])
                          for g in groups) == [("KeyError", "order <n> not found", 80),
                                               ("TimeoutError", "gateway timed out after <n>s",
                                                120)]
            page = (await client.get("/api/messages", params={"q": "k-7"})).json()
            assert page["total"] == 1
            [item] = page["items"]
            assert (item["message_id"], item["status"], item["reason"], item["attempts"],
                    item["body"]) == ("k-7", "parked", "permanent", 3, '{"order": 7}')
            assert item["headers"]["exception-message"] == "order 7 not found"
            one = (await client.get(f"/api/messages/{item['id']}")).json()
            # One message is what the list shows, and what an edit may change.
            assert one.pop("editable_headers") == {"original-exchange": "orders",
                                                   "original-routing-key": "order.created"}
            assert one == item
            text = (await client.get("/metrics")).text
            parked = metric(text, "rabbit_retry_desk_parked", queue="orders", reason="permanent")
            assert parked == 80
            assert metric(text, "rabbit_retry_desk_ingested_total", queue="orders") == 200
            assert metric(text, "rabbit_retry_desk_oldest_parked_seconds", queue="orders") > 0
            assert metric(text, "rabbit_retry_desk_oldest_parked_seconds", queue="audit") == 0
        # A desk started again on the same store keeps what it had and adds what parked since.
        await park(fresh_vhost, "orders", causes(5, 0))
        async with desk_running(topo, fresh_vhost, url) as client:
            await eventually(lambda: _parked_now(client, 205), what="205 parked")


async def depth_is(settings: Settings, queue: str, n: int) -> bool:
    return await depth(settings, queue) == n


async def test_a_group_replayed_and_another_discarded_with_the_audit(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk_with(fresh_vhost, tmp_path, 50, 30) as client:
        groups = (await client.get("/api/groups")).json()
        timeouts, missing = _group(groups, "TimeoutError"), _group(groups, "KeyError")

        replayed = await client.post("/api/replay", json={"group": timeouts["id"]})
        assert replayed.status_code == 200, replayed.text
        result = replayed.json()
        assert result["replayed"] == 50 and re.fullmatch(r"[0-9a-f]{32}", result["replay_id"])
        copies = await drain(fresh_vhost, "orders")
        assert sorted(c.message_id for c in copies) == sorted(f"t-{i}" for i in range(50))
        for c in copies:
            headers = c.properties.headers
            assert headers["replay-count"] == 1 and headers["replay-id"] == result["replay_id"]
            assert not {"parked-reason", "parked-at", "retry-count", "exception-type",
                        "x-death", "x-first-death-queue"} & set(headers), headers
            assert headers["original-exchange"] == "orders"
            assert c.body == f'{{"order": {c.message_id[2:]}}}'.encode()

        discarded = await client.post("/api/discard", json={"group": missing["id"],
                                                            "reason": "orders were deleted"})
        assert discarded.json() == {"discarded": 30}
        # Nothing is left to act on: a second replay of the group says so and records nothing.
        again = await client.post("/api/replay", json={"group": timeouts["id"]})
        assert (again.status_code, again.json()) == (409, {"error": (
            f"nothing to replay: group {timeouts['id']} has no parked messages (or a replay "
            "holds them)")})
        assert await depth(fresh_vhost, "orders") == 0

        audit = (await client.get("/api/audit")).json()
        # Without credentials (loopback only) everyone is "loopback": no name a client chose.
        assert [(a["actor"], a["action"], a["count"], a["selection"], a["reason"], a["state"])
                for a in audit] == [
            ("loopback", "discard", 30, {"group": missing["id"]}, "orders were deleted", "done"),
            ("loopback", "replay", 50, {"group": timeouts["id"]}, None, "done"),
        ]
        assert audit[1]["replay_id"] == result["replay_id"]
        statuses = (await client.get("/api/overview")).json()
        assert (statuses["parked"], statuses["replayed"], statuses["discarded"]) == (0, 50, 30)
        page = (await client.get("/api/messages", params={"status": "replayed", "limit": 1}))
        assert page.json()["total"] == 50
        assert page.json()["items"][0]["replay_id"] == result["replay_id"]
        text = (await client.get("/metrics")).text
        assert metric(text, "rabbit_retry_desk_replayed_total", queue="orders") == 50
        assert metric(text, "rabbit_retry_desk_discarded_total", queue="orders") == 30


async def test_replay_to_another_queue_and_what_the_broker_refuses(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk_with(fresh_vhost, tmp_path, 6, 0) as client:
        ids = [m["id"] for m in (await client.get("/api/messages")).json()["items"]]

        unknown = await client.post("/api/replay", json={"ids": ids[:2], "to": "nowhere"})
        assert unknown.status_code == 400
        assert unknown.json() == {"error": "\"to\": 'nowhere' is not a queue of the topology "
                                           "(one of: audit, orders)"}
        assert await _parked_now(client, 6)

        moved = await client.post("/api/replay", json={"ids": ids[:2], "to": "audit", "rate": 50})
        assert moved.json()["replayed"] == 2
        assert len(await drain(fresh_vhost, "audit")) == 2

        connection = await aiormq.connect(fresh_vhost.url)
        channel = await connection.channel()
        await channel.queue_delete("audit")
        await connection.close()
        refused = await client.post("/api/replay", json={"ids": ids[2:4], "to": "audit"})
        body = refused.json()
        assert body["replayed"] == 0 and body["refused"] == 2
        assert "queue 'audit' does not exist" in body["error"]
        assert await _parked_now(client, 4)  # the two are parked again, untouched
        audit = (await client.get("/api/audit")).json()
        assert audit[0]["state"] == "failed" and "does not exist" in audit[0]["outcome"]


async def test_copies_of_one_message_replayed_together_all_arrive(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    # One message parked three times (each park a copy of its own) among others: copies that
    # share a message id never share a batch or the channel at once, and all arrive.
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    await park(fresh_vhost, "orders", [
        Parked(b'{"order": 1}', message_id=id_, parked_at=f"2026-11-0{day}T00:00:00+00:00")
        for day, id_ in enumerate(["a", "same", "same", "b", "same", "c"], start=1)])
    async with desk_running(topo, fresh_vhost, f"sqlite:///{tmp_path / 'd.db'}") as client:
        await eventually(lambda: _parked_now(client, 6), what="6 parked")
        ids = [m["id"] for m in (await client.get("/api/messages")).json()["items"]]
        done = await client.post("/api/replay", json={"ids": ids})
        assert done.json()["replayed"] == 6, done.json()
        copies = await drain(fresh_vhost, "orders")
        assert sorted(c.message_id for c in copies) == ["a", "b", "c", "same", "same", "same"]


@pytest.mark.parametrize(("method", "path", "payload", "says"), [
    ("get", "/api/messages?limit=0", None, "limit: at least 1, not '0'"),
    ("get", "/api/messages?limit=501", None, "limit: at most 500, not '501'"),
    ("get", "/api/messages?status=gone", None, "status: 'gone' is not 'parked', 'replaying', "
                                                "'replayed' or 'discarded'"),
    ("get", "/api/messages?since=yesterday", None, "since: not an ISO-8601 time: 'yesterday'"),
    ("get", "/api/messages/abc", None, "row_id: not a message id: 'abc'"),
    ("get", "/api/groups?limit=x", None, "limit: a whole number, not 'x'"),
    ("post", "/api/replay", {}, 'say which messages: "ids": [...] or "group": ID (one of the two)'),
    ("post", "/api/replay", {"ids": [1], "group": "0123456789abcdef"},
     'say which messages: "ids": [...] or "group": ID (one of the two)'),
    ("post", "/api/replay", {"ids": ["1"]}, "ids[0]: a whole number, not '1'"),
    ("post", "/api/replay", {"ids": [True]}, "ids[0]: a whole number, not True"),
    ("post", "/api/replay", {"ids": []}, "ids: at least 1 item(s)"),
    ("post", "/api/replay", {"group": "x"}, "group: not a group id: 'x'"),
    ("post", "/api/replay", {"ids": [1], "rate": 0}, "rate: above 0, not 0"),
    ("post", "/api/replay", {"ids": [1], "to": 7}, "to: text, not 7"),
    ("post", "/api/replay", {"ids": [1], "who": "x"}, "who: unknown field"),
    ("post", "/api/discard", {"ids": [1]}, "reason: required"),
    ("post", "/api/discard", {"ids": [1], "reason": "  "}, '"reason": a discard needs a reason '
                                                           "(text)"),
    ("post", "/api/discard", [1], "the request body must be a JSON object"),
    ("post", "/api/replay", {"ids": list(range(1, 10_002))}, "ids: at most 10,000 items"),
])
async def test_bad_requests_get_one_line_and_change_nothing(
    fresh_vhost: Settings, tmp_path: Path, method: str, path: str, payload: Any, says: str
) -> None:
    async with desk_with(fresh_vhost, tmp_path, 2, 0) as client:
        if method == "get":
            response = await client.get(path)
        else:
            response = await client.post(path, json=payload)
        assert (response.status_code, response.json()) == (400, {"error": says})
        assert await _parked_now(client, 2)
        assert (await client.get("/api/audit")).json() == []
        missing = await client.get("/api/messages/999")
        assert (missing.status_code, missing.json()) == (404, {"error": "no message 999"})


async def test_with_a_token_every_request_needs_it_and_the_page_needs_csrf(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk_with(fresh_vhost, tmp_path, 3, 0, token=TOKEN) as client:
        base = str(client.base_url)
        async with httpx.AsyncClient(base_url=base) as anonymous:
            for path in ("/api/overview", "/api/messages", "/metrics", "/api/audit"):
                response = await anonymous.get(path)
                assert response.status_code == 401, path
                assert "needs its token" in response.json()["error"]
            wrong = await anonymous.get("/api/overview", headers={"Authorization": "Bearer no"})
            assert (wrong.status_code, wrong.json()) == (401, {"error": "wrong credentials "
                                                               "(Authorization)"})
            refused = await anonymous.post("/api/discard", json={"ids": [1], "reason": "x"})
            assert refused.status_code == 401
            page = await anonymous.get("/")
            assert (page.status_code, page.headers["location"]) == (303, "/login")
            failed = await anonymous.post("/login", data={"token": "guess"})
            assert (failed.status_code, failed.headers["location"]) == (303, "/login?failed=1")
            assert "rabbit_retry_desk" not in anonymous.cookies

        async with httpx.AsyncClient(base_url=base) as browser:
            login = await browser.post("/login", data={"token": TOKEN})
            assert (login.status_code, login.headers["location"]) == (303, "/")
            session = login.headers.get_list("set-cookie")
            assert any("rabbit_retry_desk=" in c and "HttpOnly" in c and "SameSite=strict" in c
                       for c in session), session
            assert TOKEN not in " ".join(session)
            assert (await browser.get("/api/overview")).json()["auth"] == "token"
            no_csrf = await browser.post("/api/discard", json={"ids": [1], "reason": "x"})
            assert no_csrf.status_code == 403 and "X-CSRF-Token" in no_csrf.json()["error"]
            csrf = browser.cookies["rabbit_retry_csrf"]
            cross = await browser.post("/api/discard", json={"ids": [1], "reason": "x"},
                                       headers={"X-CSRF-Token": csrf,
                                                "Origin": "http://evil.example"})
            assert cross.status_code == 403
            assert await _parked_now(client, 3)
            ok = await browser.post("/api/discard", json={"ids": [1], "reason": "x"},
                                    headers={"X-CSRF-Token": csrf, "Origin": base.rstrip("/")})
            assert ok.json() == {"discarded": 1}
            assert "script-src 'self'" in ok.headers["content-security-policy"]
            assert ok.headers["x-frame-options"] == "DENY"


def test_without_a_token_the_desk_refuses_to_listen_beyond_loopback(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "t.yml"
    path.write_text(TOPOLOGY)
    ran = cli(fresh_vhost, "desk", str(path), "--listen", "0.0.0.0:8025", "--store",
              f"sqlite:///{tmp_path / 'd.db'}", env={"RABBIT_RETRY_DESK_TOKEN": ""})
    assert ran.code == 2
    assert ran.err.strip() == ("error: --listen 0.0.0.0:8025: without RABBIT_RETRY_DESK_TOKEN "
                               "or --access FILE the desk listens on loopback only (127.0.0.1, "
                               "::1); set one to listen elsewhere")
    assert not (tmp_path / "d.db").exists()
    access = tmp_path / "access.yml"
    access.write_text("operators: {ana: {role: admin, secret_env: X}}\n")
    for args, says in (
        (["--access", str(tmp_path / "none.yml")], f"error: {tmp_path / 'none.yml'}: no such file"),
        (["--access", str(access)], f"error: {access}: operators.ana.role: Input should be "
                                    "'viewer' or 'operator'"),
        (["--store", "mysql://x/y"], "error: --store: unsupported database 'mysql'"),
        (["--listen", "nowhere"], "error: --listen 'nowhere': expected HOST:PORT"),
        (["--keep", "soon"], "error: --keep: bad duration 'soon'"),
    ):
        ran = cli(fresh_vhost, "desk", str(path), *args)
        assert ran.code == 2 and ran.err.startswith(says), ran.err
        assert len(ran.err.strip().splitlines()) == 1


async def test_the_store_down_keeps_parked_messages_in_their_queue_until_it_is_back(
    fresh_vhost: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import psycopg
    from support.stores import POSTGRES_URL

    caplog.set_level(logging.INFO, logger="rabbit_retry.desk")
    topo = topology(TOPOLOGY)
    await provision(fresh_vhost, topo)
    with store_url("postgresql", Path("/nonexistent")) as url:
        name = url.rsplit("/", 1)[1]

        def connections(allowed: bool) -> None:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
                if not allowed:
                    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = %s", (name,))

        async with desk_running(topo, fresh_vhost, url) as client:
            await park(fresh_vhost, "orders", causes(10, 0))
            await eventually(lambda: _parked_now(client, 10), what="10 stored")
            connections(False)
            try:
                await park(fresh_vhost, "orders", causes(0, 40))
                await eventually(
                    lambda: any("parked messages failed" in r.getMessage()
                                for r in caplog.records), what="the failure logged")
                await asyncio.sleep(2)  # several retries, held unacked meanwhile
            finally:
                connections(True)
            await eventually(lambda: _parked_now(client, 50), what="all 50 stored", within=60)
            await eventually(lambda: depth_is(fresh_vhost, "orders.parking", 0),
                             what="the parking queue emptied")
        failed = [r for r in caplog.records if "parked messages failed" in r.getMessage()]
        assert len(failed) == 1, [r.getMessage() for r in failed]  # once, not per attempt
        [back] = [m for r in caplog.records
                  if (m := re.search(r"works again after (\d+) failed", r.getMessage()))]
        assert int(back.group(1)) >= 2  # the control: "once" covered several failed attempts


async def test_a_parking_queue_deleted_under_the_desk_is_consumed_again_once_restored(
    fresh_vhost: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="rabbit_retry.desk")
    topo = topology(TOPOLOGY)
    async with desk_with(fresh_vhost, tmp_path, 2, 0) as client:
        connection = await aiormq.connect(fresh_vhost.url)
        channel = await connection.channel()
        await channel.queue_delete("orders.parking")
        await connection.close()
        await eventually(lambda: any("does not exist" in r.getMessage() for r in caplog.records),
                         what="the missing parking queue reported")
        await provision(fresh_vhost, topo)
        await park(fresh_vhost, "orders", causes(0, 3))
        await eventually(lambda: _parked_now(client, 5), what="the new ones stored", within=90)
