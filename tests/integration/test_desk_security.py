"""Who may use the desk, against a real desk: named operators with their own secrets and roles,
a read-only /metrics credential, a trusted proxy's header (from its address only), sessions
that are new per login, signed, expiring and ended by logout, throttled and logged logins, and
the Host check in every mode. Every refusal changes nothing."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from support.desk import ACCESS, SECRETS, TOKEN, access_of, desk_running
from support.parked import Parked, park
from support.poll import eventually
from support.provision import provision, topology

from rabbit_retry.desk.schema import sessions
from rabbit_retry.desk.store import Store
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
queues:
  orders:
    retry: {delays: [1s], max_attempts: 2}
"""
N = 3


@contextlib.asynccontextmanager
async def desk(settings: Settings, tmp_path: Path, access: str | None = ACCESS,
               **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A desk with ``N`` parked messages; its client signs in as ana (an operator)."""
    topo = topology(TOPOLOGY)
    await provision(settings, topo)
    await park(settings, "orders", [Parked(b'{"n": %d}' % i, message_id=f"m-{i}")
                                    for i in range(N)])
    granted = access_of(access, tmp_path) if access is not None else None
    kwargs.setdefault("as_user", "ana" if access is not None else None)
    async with desk_running(topo, settings, f"sqlite:///{tmp_path / 'd.db'}", access=granted,
                            **kwargs) as client:
        await eventually(lambda: _parked(client, N), what=f"{N} parked")
        yield client


async def _parked(client: httpx.AsyncClient, n: int) -> bool:
    response = await client.get("/api/overview")
    return response.status_code == 200 and response.json()["parked"] == n


def _as(client: httpx.AsyncClient, user: str | None, **kwargs: Any) -> httpx.AsyncClient:
    kwargs.setdefault("auth", (user, SECRETS[user]) if user else None)
    return httpx.AsyncClient(base_url=str(client.base_url), timeout=60, **kwargs)


async def test_named_operators_act_under_their_own_name_and_viewers_only_read(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as ana:
        # The audit names who authenticated; a name the client sends counts for nothing.
        done = await ana.post("/api/discard", json={"ids": [1], "reason": "bad"},
                              headers={"X-Actor": "mallory"})
        assert done.json() == {"discarded": 1}
        [entry] = (await ana.get("/api/audit")).json()
        assert entry["actor"] == "ana"
        assert (await ana.get("/api/me")).json() == {
            "name": "ana", "role": "operator", "mode": "operators", "may_act": True,
            "logout": False, "loopback": False, "outbox": False}

        async with _as(ana, "vic") as vic:
            assert (await vic.get("/api/messages")).json()["total"] == N
            assert (await vic.get("/api/me")).json()["may_act"] is False
            for path, body in (("/api/replay", {"ids": [2]}),
                               ("/api/discard", {"ids": [2], "reason": "x"}),
                               ("/api/restore", {"ids": [1]}),
                               ("/api/rules", {"pattern": "x+", "name": "x"})):
                refused = await vic.post(path, json=body)
                assert (refused.status_code, refused.json()) == (403, {"error": (
                    "vic is a viewer: replay, discard, restore and edit need the operator "
                    "role")}), path
        async with _as(ana, None) as nobody:
            refused = await nobody.get("/api/messages")
            assert (refused.status_code, refused.json()) == (401, {"error": (
                "who are you? Authorization: Basic NAME:SECRET (curl -u), or log in at "
                "/login")})
        async with _as(ana, None, auth=("ana", "not her secret")) as forger:
            refused = await forger.post("/api/replay", json={"ids": [2]})
            assert (refused.status_code, refused.json()) == (
                401, {"error": "wrong credentials (Authorization)"})
        assert await _parked(ana, N - 1)
        assert len((await ana.get("/api/audit")).json()) == 1  # the refusals wrote nothing


async def test_metrics_have_a_read_only_credential_of_their_own(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as ana:
        scrape = {"Authorization": f"Bearer {SECRETS['metrics']}"}
        async with _as(ana, None) as prometheus:
            metrics = await prometheus.get("/metrics", headers=scrape)
            assert metrics.status_code == 200
            assert 'rabbit_retry_desk_parked{queue="orders",reason="exhausted"} 3.0' in metrics.text
            for path in ("/api/messages", "/api/audit"):
                refused = await prometheus.get(path, headers=scrape)
                assert (refused.status_code, refused.json()) == (
                    403, {"error": "metrics may read /metrics only"})
            refused = await prometheus.post("/api/discard", headers=scrape,
                                            json={"ids": [1], "reason": "x"})
            assert refused.status_code == 403
            assert (await prometheus.get("/metrics")).status_code == 401
        assert (await ana.get("/metrics")).status_code == 200  # an operator may read it too
        assert await _parked(ana, N)


async def test_a_session_is_random_per_login_signed_expiring_and_ended_by_logout(
    fresh_vhost: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_retry.desk")
    async with desk(fresh_vhost, tmp_path) as ana:
        base = str(ana.base_url)

        async def login(name: str = "ana") -> httpx.AsyncClient:
            browser = httpx.AsyncClient(base_url=base, timeout=60)
            answer = await browser.post("/login", data={"name": name, "secret": SECRETS[name]})
            assert (answer.status_code, answer.headers["location"]) == (303, "/")
            return browser

        first, second = await login(), await login()
        cookies = [b.cookies["rabbit_retry_desk"] for b in (first, second)]
        assert cookies[0] != cookies[1]
        assert all(SECRETS["ana"] not in c for c in cookies)
        assert (await first.get("/api/me")).json()["name"] == "ana"
        assert any("ana logged in from 127.0.0.1 (operator)" in r.getMessage()
                   for r in caplog.records)

        # A forged signature is refused before the store is asked; a valid one still works.
        session_id, _, mac = cookies[0].rpartition(".")
        async with httpx.AsyncClient(base_url=base, cookies={
                "rabbit_retry_desk": f"{session_id}.{mac[::-1]}"}) as forged:
            assert (await forged.get("/api/overview")).status_code == 401
        assert (await first.get("/api/overview")).status_code == 200

        # Logout ends the session in the store: its cookie, sent again, opens nothing.
        csrf = first.cookies["rabbit_retry_csrf"]
        assert (await first.post("/logout", headers={"X-CSRF-Token": csrf})).json() == {
            "ok": True}
        async with httpx.AsyncClient(base_url=base,
                                     cookies={"rabbit_retry_desk": cookies[0]}) as replayed:
            assert (await replayed.get("/api/overview")).status_code == 401
            assert (await replayed.post("/api/discard", json={"ids": [1], "reason": "x"},
                                        headers={"X-CSRF-Token": csrf})).status_code == 401
        assert (await second.get("/api/overview")).status_code == 200  # the other one lives

        # An expired session ends too (its row says until when).
        store = Store(f"sqlite:///{tmp_path / 'd.db'}")
        with store.engine.begin() as tx:
            tx.execute(sessions.update().values(expires_at=sa.func.datetime("now", "-1 second")))
        store.close()
        assert (await second.get("/api/overview")).status_code == 401
        for browser in (first, second):
            await browser.aclose()
        assert await _parked(ana, N)


async def test_a_session_posts_only_with_its_own_csrf_token(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    async with desk(fresh_vhost, tmp_path) as ana:
        base = str(ana.base_url)
        async with httpx.AsyncClient(base_url=base) as browser:
            await browser.post("/login", data={"name": "ana", "secret": SECRETS["ana"]})
            body = {"ids": [1], "reason": "x"}
            for headers in ({}, {"X-CSRF-Token": "forged"},
                            {"X-CSRF-Token": browser.cookies["rabbit_retry_csrf"],
                             "Origin": "http://evil.example"}):
                refused = await browser.post("/api/discard", json=body, headers=headers)
                assert refused.status_code == 403, headers
            assert await _parked(ana, N)
            done = await browser.post("/api/discard", json=body, headers={
                "X-CSRF-Token": browser.cookies["rabbit_retry_csrf"], "Origin": base.rstrip("/")})
            assert done.json() == {"discarded": 1}  # the control: with its token it goes


async def test_failed_logins_are_throttled_and_logged(
    fresh_vhost: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rabbit_retry.desk")
    async with desk(fresh_vhost, tmp_path) as ana:
        async with httpx.AsyncClient(base_url=str(ana.base_url)) as guesser:
            for attempt in range(5):
                refused = await guesser.post("/login", data={"name": "vic",
                                                             "secret": f"guess-{attempt}"})
                assert refused.headers["location"] == "/login?failed=1", attempt
            # Locked out: even the right secret is refused now, and says for how long.
            locked = await guesser.post("/login", data={"name": "vic", "secret": SECRETS["vic"]})
            assert locked.headers["location"].startswith("/login?failed=throttled&wait=")
            assert "rabbit_retry_desk" not in guesser.cookies
            api = await guesser.get("/api/overview", auth=("vic", SECRETS["vic"]))
            assert api.status_code == 429 and int(api.headers["retry-after"]) >= 1
            assert api.json()["error"].startswith("too many failed logins; try again in ")
        failed = [r.getMessage() for r in caplog.records if "failed login" in r.getMessage()]
        assert failed == ["desk: failed login (wrong secret) from 127.0.0.1 as 'vic'"] * 5
        assert all("guess" not in r.getMessage() for r in caplog.records)  # never a secret


async def test_a_trusted_proxy_names_who_is_there_and_only_from_its_address(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    trusted = ACCESS + "proxy: {header: X-Forwarded-User, trusted: [127.0.0.1], role: viewer}\n"
    async with desk(fresh_vhost, tmp_path, access=trusted) as ana, _as(ana, None) as proxy:
        me = await proxy.get("/api/me", headers={"X-Forwarded-User": "ana"})
        assert me.json()["name"] == "ana" and me.json()["may_act"] is True
        zed = await proxy.get("/api/me", headers={"X-Forwarded-User": "zed"})
        assert (zed.json()["name"], zed.json()["role"]) == ("zed", "viewer")
        # A browser behind the proxy posts with the page's CSRF cookie, like any browser.
        page = await proxy.get("/", headers={"X-Forwarded-User": "ana"})
        csrf = page.cookies["rabbit_retry_csrf"]
        done = await proxy.post("/api/discard", json={"ids": [1], "reason": "via proxy"},
                                headers={"X-Forwarded-User": "ana", "X-CSRF-Token": csrf},
                                cookies={"rabbit_retry_csrf": csrf})
        assert done.json() == {"discarded": 1}
        assert (await ana.get("/api/audit")).json()[0]["actor"] == "ana"
    untrusted = ACCESS + "proxy: {header: X-Forwarded-User, trusted: [10.9.9.9]}\n"
    (tmp_path / "again").mkdir()
    async with (desk(fresh_vhost, tmp_path / "again", access=untrusted) as ana,
                _as(ana, None) as forger):
        refused = await forger.get("/api/me", headers={"X-Forwarded-User": "ana"})
        assert refused.status_code == 401  # not from the proxy: the header means nothing


@pytest.mark.parametrize("mode", ["loopback", "token", "operators"])
async def test_dns_rebinding_gets_400_in_every_mode(fresh_vhost: Settings, tmp_path: Path,
                                                    mode: str) -> None:
    kwargs: dict[str, Any] = {"token": TOKEN, "access": None} if mode == "token" else (
        {"access": None} if mode == "loopback" else {})
    async with desk(fresh_vhost, tmp_path, **kwargs) as client:
        evil = {"Host": "evil.example:18932"}
        for method, path in (("GET", "/"), ("GET", "/api/overview"), ("GET", "/login"),
                             ("POST", "/api/discard")):
            refused = await client.request(method, path, headers=evil,
                                           json={"ids": [1], "reason": "x"})
            assert refused.status_code == 400, (method, path)
            assert refused.json() == {"error": (
                "Host 'evil.example' is not a name of this desk (an address, localhost, or one "
                "listed in RABBIT_RETRY_DESK_HOSTS or the access file's hosts:)")}
            assert "set-cookie" not in refused.headers
        assert (await client.get("/api/overview", headers={"Host": "localhost"})
                ).status_code == 200  # the control
        assert await _parked(client, N)


async def test_a_name_listed_in_hosts_is_served(fresh_vhost: Settings, tmp_path: Path) -> None:
    async with desk(fresh_vhost, tmp_path, access=ACCESS + "hosts: [desk.example.com]\n") as ana:
        ok = await ana.get("/api/overview", headers={"Host": "desk.example.com:8025"})
        assert ok.status_code == 200
        assert (await ana.get("/api/overview", headers={"Host": "desk.example.org"})
                ).status_code == 400
