"""Whatever a client sends the desk's API, the answer is never a 5xx: generated paths, query
values and JSON bodies (valid shapes with hostile values, and anything at all) against every
route, in process, on a store with messages in it and a real broker behind replays. A refusal is
4xx with one line of JSON; the control: valid requests among them do succeed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands as spec
from support.provision import provision_sync

from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.app import Desk, create_app
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.store import Store, now
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
queues:
  orders: {queue_type: classic}
"""

ROUTES = [
    ("GET", "/api/overview"), ("GET", "/api/queues"), ("GET", "/api/groups"),
    ("GET", "/api/groups/{group}"), ("GET", "/api/groups/{group}/notes"),
    ("GET", "/api/messages"), ("GET", "/api/messages/{row}"),
    ("GET", "/api/messages/{row}/history"), ("GET", "/api/audit"),
    ("GET", "/api/replays/{replay}"), ("GET", "/api/rules"), ("GET", "/metrics"),
    ("GET", "/api/me"), ("POST", "/api/replay"), ("POST", "/api/discard"),
    ("POST", "/api/restore"), ("POST", "/api/messages/{row}/edit"),
    ("POST", "/api/replays/{replay}/cancel"), ("POST", "/api/groups/{group}/notes"),
    ("POST", "/api/rules"), ("DELETE", "/api/rules/{row}"),
    ("GET", "/api/held"), ("GET", "/api/outbox"), ("GET", "/api/outbox/{row}"),
    ("POST", "/api/outbox/retry"), ("POST", "/api/outbox/discard"),
]
QUERY = ["queue", "group", "status", "q", "since", "until", "limit", "offset", "replay",
         "source", "x"]
FIELDS = ["ids", "group", "to", "rate", "wait", "reason", "body", "body_base64", "headers",
          "text", "pattern", "name", "queue"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "1", "0", "-1", "99999999999999999999999", "\u00b9", "\u0663", "1e9",
                     "orders", "parked", "0123456789abcdef", "Infinity", "%", "_", "'",
                     "a=b", "tenant=acme", "(", "a*", "\x00"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    values,
)
segments = st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(
    ["1", "2", "0", "99999999999999999999999", "%C2%B9", "%D9%A3", "0123456789abcdef",
     "0" * 32, "..", "%00", "1.5", "-3"]))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory,
           vhost_factory: Any) -> Iterator[TestClient]:
    from rabbit_retry.topology import parse_topology

    vhost: Settings = vhost_factory()
    provision_sync(vhost, TOPOLOGY)
    path: Path = tmp_path_factory.mktemp("fuzz") / "desk.db"
    store = Store(f"sqlite:///{path}")
    store.migrate()
    store.insert([parked("orders", b'{"n": %d}' % i, spec.Basic.Properties(
        message_id=f"m-{i}", headers={"parked-reason": "exhausted", "parked-id": str(i),
                                      "exception-message": f"order {i} failed"}),
        now=now()) for i in range(50)])
    topo = parse_topology(TOPOLOGY)
    desk = Desk(store, Actions(store, vhost, set(topo.queue_names)), list(topo.queue_names))
    with TestClient(create_app(desk), base_url="http://127.0.0.1") as test_client:
        yield test_client
    store.close()


def _path(template: str, segment: str) -> str:
    encoded = segment if segment.startswith("%") else quote(segment, safe="")
    return (template.replace("{group}", encoded).replace("{row}", encoded)
            .replace("{replay}", encoded))


def _check(response: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error, str) and error and "\n" not in error, response.text[:300]


@given(route=st.sampled_from(ROUTES), segment=segments,
       query=st.dictionaries(st.sampled_from(QUERY), st.text(max_size=40) | st.sampled_from(
           ["0", "501", "1e3", "-1", "parked", "any", "yesterday", "2026-13-45", "\u0663"]),
           max_size=4),
       body=bodies)
@settings(max_examples=400, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_no_request_is_answered_with_a_5xx(client: TestClient, route: tuple[str, str],
                                           segment: str, query: dict[str, str],
                                           body: Any) -> None:
    method, template = route
    kwargs: dict[str, Any] = {"params": query}
    if method == "POST":
        kwargs["content"] = json.dumps(body, allow_nan=True)
        kwargs["headers"] = {"Content-Type": "application/json"}
    _check(client.request(method, _path(template, segment), **kwargs))


@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
       route=st.sampled_from([r for r in ROUTES if r[0] == "POST"]))
@settings(max_examples=100, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
def test_no_body_is_answered_with_a_5xx(client: TestClient, raw: bytes,
                                        route: tuple[str, str]) -> None:
    _check(client.post(_path(route[1], "1"), content=raw,
                       headers={"Content-Type": "application/json"}))


def test_the_control_valid_requests_among_them_succeed(client: TestClient) -> None:
    assert client.get("/api/messages", params={"limit": 5}).status_code == 200
    groups = client.get("/api/groups")
    assert groups.status_code == 200
    note = client.post(f"/api/groups/{groups.json()[0]['id']}/notes", json={"text": "ok"})
    assert note.status_code == 200
    assert client.post("/api/discard", json={"ids": [50], "reason": "x"}).status_code in (
        200, 409)


def test_the_control_the_same_requests_find_a_5xx_where_there_is_one() -> None:
    """A route that trusts its input (int() of the path, as the desk once did) is caught."""
    from fastapi import FastAPI
    from hypothesis import find

    toy = FastAPI()

    @toy.get("/api/messages/{row}")
    def naive(row: str) -> dict[str, int]:
        return {"id": int(row) + 1}

    with TestClient(toy, raise_server_exceptions=False) as naive_client:
        found = find(segments, lambda s: naive_client.get(_path("/api/messages/{row}", s))
                     .status_code >= 500, settings=settings(max_examples=200, deadline=None))
    assert found
