"""Issue 22's findings, reproduced against the desk as it was (token and loopback modes only):
each must fail before the fix and pass after it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.desk import TOKEN, desk_running
from support.parked import Parked, park
from support.poll import eventually
from support.provision import provision, topology

from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
queues:
  orders:
    retry: {delays: [1s], max_attempts: 2}
"""


@contextlib.asynccontextmanager
async def desk(settings: Settings, tmp_path: Path, n: int = 3,
               **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    topo = topology(TOPOLOGY)
    await provision(settings, topo)
    await park(settings, "orders", [Parked(b'{"n": %d}' % i, message_id=f"m-{i}",
                                           exception_type="KeyError",
                                           headers={"exception-message": f"'sku-AB{i:05d}'"})
                                    for i in range(n)])
    async with desk_running(topo, settings, f"sqlite:///{tmp_path / 'd.db'}", **kwargs) as c:
        await eventually(lambda: _parked(c, n), what=f"{n} parked")
        yield c


async def _parked(client: httpx.AsyncClient, n: int) -> bool:
    return bool((await client.get("/api/overview")).json()["parked"] == n)


async def test_dns_rebinding_is_refused_without_a_token(fresh_vhost: Settings,
                                                       tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        evil = {"Host": "evil.example:18932"}
        page = await client.get("/", headers=evil)
        assert page.status_code == 400 and "set-cookie" not in page.headers
        assert (await client.get("/api/overview", headers=evil)).status_code == 400
        discard = await client.post("/api/discard", json={"ids": [1], "reason": "x"},
                                    headers={**evil, "Origin": "http://evil.example:18932"})
        assert discard.status_code == 400
        assert await _parked(client, 3)


async def test_a_session_is_new_per_login_and_ends_at_logout(fresh_vhost: Settings,
                                                             tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path, token=TOKEN) as client:
        base = str(client.base_url)
        cookies = []
        for _ in range(2):
            async with httpx.AsyncClient(base_url=base) as browser:
                await browser.post("/login", data={"token": TOKEN})
                cookies.append(browser.cookies["rabbit_retry_desk"])
        assert cookies[0] != cookies[1]
        async with httpx.AsyncClient(base_url=base) as browser:
            await browser.post("/login", data={"token": TOKEN})
            session = browser.cookies["rabbit_retry_desk"]
            csrf = browser.cookies["rabbit_retry_csrf"]
            assert (await browser.post("/logout", headers={"X-CSRF-Token": csrf})).status_code \
                == 200
        async with httpx.AsyncClient(base_url=base,
                                     cookies={"rabbit_retry_desk": session}) as replayed:
            assert (await replayed.get("/api/overview")).status_code == 401


async def test_the_audit_names_who_authenticated_not_who_the_client_says(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path, token=TOKEN) as client:
        await client.post("/api/discard", json={"ids": [1], "reason": "x"},
                          headers={"X-Actor": "mallory"})
        [entry] = (await client.get("/api/audit")).json()
        assert entry["actor"] != "mallory"


async def test_a_body_too_large_is_413(fresh_vhost: Settings, tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        big = b'{"ids": [1], "reason": "' + b"x" * (50 * 2**20) + b'"}'
        response = await client.post("/api/discard", content=big,
                                     headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert await _parked(client, 3)


@pytest.mark.parametrize(("method", "path", "payload"), [
    ("post", "/api/replay", {"ids": [99999999999999999999999999]}),
    ("get", "/api/messages/99999999999999999999999", None),
    ("get", "/api/messages/%C2%B9", None),
    ("get", "/api/messages/%D9%A3", None),
    ("get", "/api/messages?q=" + "x" * 50_001, None),
    ("post", "/api/replay", {"ids": [1], "rate": float("inf")}),
])
async def test_bad_input_is_a_4xx(fresh_vhost: Settings, tmp_path: Path, method: str,
                                  path: str, payload: Any) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        if payload is not None:
            import json

            content = json.dumps(payload)  # Infinity as Python writes it
            response = await client.post(path, content=content,
                                         headers={"Content-Type": "application/json"})
        else:
            response = await client.request(method.upper(), path)
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
        assert len(response.json()["error"].splitlines()) == 1
        assert (await client.get("/api/audit")).json() == []


async def test_a_body_nested_100000_deep_is_a_4xx(fresh_vhost: Settings,
                                                  tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        response = await client.post("/api/replay", content="[" * 100_000 + "]" * 100_000,
                                     headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text[:200]


async def test_an_action_that_selects_nothing_says_so_and_writes_no_audit(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as client:
        assert (await client.post("/api/discard", json={"ids": [1], "reason": "x"})).json() \
            == {"discarded": 1}
        for ids in ([1], [12345]):  # discarded; unknown
            response = await client.post("/api/replay", json={"ids": ids})
            assert 400 <= response.status_code < 500, response.text
        assert len((await client.get("/api/audit")).json()) == 1


async def test_a_thousand_sku_key_errors_are_one_group(fresh_vhost: Settings,
                                                       tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path, n=1000) as client:
        groups = (await client.get("/api/groups")).json()
        assert [(g["exception_message"], g["count"]) for g in groups] == [("'sku-<id>'", 1000)]


async def test_the_parked_gauge_reads_zero_when_nothing_is_parked(fresh_vhost: Settings,
                                                                  tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path, n=1) as client:
        assert 'rabbit_retry_desk_parked{queue="orders",reason="exhausted"} 1.0' in (
            await client.get("/metrics")).text
        await client.post("/api/discard", json={"ids": [1], "reason": "x"})
        assert 'rabbit_retry_desk_parked{queue="orders",reason="exhausted"} 0.0' in (
            await client.get("/metrics")).text
