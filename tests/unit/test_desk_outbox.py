"""The desk's outbox and held keys through its API, in process on SQLite (no broker): an
application's dead and failed outbox events listed beside the parked messages, shown with their
history, retried or discarded by an operator with the desk's guard and audit; the ordered keys
a parked message holds, and the message holding each."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pamqp import commands as spec
from support.desk import SECRETS, access_of
from support.outbox import migrated, refused_events, statuses

from rabbit_retry import contract
from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.app import Desk, create_app
from rabbit_retry.desk.auth import Access
from rabbit_retry.desk.outbox import DeskOutbox
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.serve import open_outbox
from rabbit_retry.desk.store import Store
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
queues:
  shop.orders:
    bindings: [{exchange: shop, routing_key: "order.*"}]
    ordered: {key: {header: customer}, lanes: 2}
  shop.mail: {}
"""
T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
OPERATORS = """\
operators:
  ana: {role: operator, secret_env: DESK_TEST_ANA}
  vic: {role: viewer, secret_env: DESK_TEST_VIC}
"""


def _parked(i: int, queue: str = "shop.orders", **headers: Any) -> Any:
    props = spec.Basic.Properties(message_id=f"m-{i}", headers={
        "parked-reason": "permanent", "exception-type": "KeyError",
        "exception-message": f"order {i} not found", "parked-id": str(i),
        "parked-at": (T0 + dt.timedelta(minutes=i)).isoformat(), **headers})
    return parked(queue, b'{"n": %d}' % i, props, now=T0)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    path = tmp_path / "shop.yml"
    path.write_text(TOPOLOGY)
    return path


@pytest.fixture
def outbox_url(tmp_path: Path, files: Path) -> str:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(url)
    return url


def _client(tmp_path: Path, outbox_url: str | None,
            access: Access | None = None) -> Iterator[tuple[TestClient, Store]]:
    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    outbox = DeskOutbox(outbox_url) if outbox_url else None
    settings = Settings.from_env("amqp://guest:guest@127.0.0.1:1/", None)
    desk = Desk(store, Actions(store, settings, {"shop.orders", "shop.mail"}),
                ["shop.orders", "shop.mail"], access, outbox=outbox)
    try:
        with TestClient(create_app(desk), base_url="http://127.0.0.1") as client:
            yield client, store
    finally:
        if outbox is not None:
            outbox.close()
        store.close()


@pytest.fixture
def desk(tmp_path: Path, outbox_url: str) -> Iterator[tuple[TestClient, Store]]:
    yield from _client(tmp_path, outbox_url)


def _dead_and_failed(url: str, files: Path) -> dict[str, int]:
    return refused_events(
        url, files,
        dead={"lost-1": {"exchange": "shop", "routing_key": "order.lost", "key": "c-7",
                         "body": '<img src=x onerror="alert(1)">',
                         "headers": {"tenant": "<script>alert(2)</script>"}},
              "lost-2": {"exchange": "shop", "routing_key": "order.lost", "body": b"\xff"}},
        failed={"late-1": {"queue": "shop.mail", "body": "{}"}})


def test_dead_and_failed_events_are_listed_with_their_reason_and_shown_with_history(
    desk: tuple[TestClient, Store], outbox_url: str, files: Path,
) -> None:
    client, _store = desk
    ids = _dead_and_failed(outbox_url, files)
    listed = client.get("/api/outbox").json()
    assert listed["total"] == 3
    by_id = {e["message_id"]: e for e in listed["items"]}
    assert set(by_id) == {"lost-1", "lost-2", "late-1"}
    lost = by_id["lost-1"]
    assert (lost["id"], lost["status"], lost["exchange"], lost["routing_key"], lost["key"],
            lost["attempts"]) == (ids["lost-1"], "dead", "shop", "order.lost", "c-7", 1)
    assert lost["error"] == "unroutable: no queue is bound to 'order.lost'"
    assert lost["body"] == '<img src=x onerror="alert(1)">'  # as text: the page shows it so
    assert lost["created_at"].endswith("Z") and lost["changed_at"].endswith("Z")
    assert by_id["lost-2"]["body_base64"] == "/w=="
    assert (by_id["late-1"]["status"], by_id["late-1"]["destination"]) == ("failed", "shop.mail")
    assert by_id["late-1"]["due_at"] is not None
    # Filtered by status, destination, message id or key; paged.
    assert [e["message_id"] for e in client.get("/api/outbox?status=failed").json()["items"]] \
        == ["late-1"]
    assert client.get("/api/outbox?status=dead").json()["total"] == 2
    assert client.get("/api/outbox?destination=shop.mail").json()["total"] == 1
    assert [e["message_id"] for e in client.get("/api/outbox?q=c-7").json()["items"]] \
        == ["lost-1"]
    page = client.get("/api/outbox?limit=2&offset=2").json()
    assert (page["total"], len(page["items"])) == (3, 1)
    assert client.get("/api/outbox?status=published").status_code == 400
    one = client.get(f"/api/outbox/{ids['lost-1']}").json()
    assert [(h["status"], h["detail"], h["actor"]) for h in one["history"]] == [
        ("pending", "added", None),
        ("failed", "unroutable: no queue is bound to 'order.lost'", "relay-test"),
        ("dead", "failed 1 times", "relay-test")]
    assert client.get("/api/outbox/999").status_code == 404
    overview = client.get("/api/overview").json()
    assert overview["outbox"] == {"dead": 2, "failed": 1}
    assert client.get("/api/me").json()["outbox"] is True


def test_an_operator_retries_and_discards_with_the_audit_and_nothing_twice(
    desk: tuple[TestClient, Store], outbox_url: str, files: Path,
) -> None:
    client, _store = desk
    ids = _dead_and_failed(outbox_url, files)
    retried = client.post("/api/outbox/retry", json={"ids": [ids["lost-1"], ids["late-1"]],
                                                     "reason": "queue bound now"})
    assert retried.status_code == 200, retried.text
    assert retried.json() == {"retried": 2, "skipped": 0}
    assert statuses(outbox_url) == {"pending": 2, "dead": 1}  # for the relay: the desk never
    event = client.get(f"/api/outbox/{ids['lost-1']}").json()  # publishes
    assert (event["status"], event["attempts"]) == ("pending", 0)
    assert event["history"][-1]["actor"] == "loopback"
    # Discard needs a reason; what is not dead or failed is skipped, and an action that takes
    # nothing is refused (409) and writes no audit entry.
    assert client.post("/api/outbox/discard", json={"ids": [ids["lost-2"]]}).status_code == 400
    assert client.post("/api/outbox/discard", json={"ids": [ids["lost-2"]],
                                                    "reason": " "}).status_code == 400
    discarded = client.post("/api/outbox/discard", json={
        "ids": [ids["lost-2"], ids["lost-1"]], "reason": "sent by mistake"})
    assert discarded.json() == {"discarded": 1, "skipped": 1}
    again = client.post("/api/outbox/retry", json={"ids": [ids["lost-1"]]})
    assert again.status_code == 409
    assert again.json()["error"] == (f"nothing to retry: outbox event {ids['lost-1']} is "
                                     "pending, not dead or failed")
    assert client.post("/api/outbox/retry", json={"ids": [424242]}).status_code == 404
    assert client.post("/api/outbox/retry", json={"ids": []}).status_code == 400
    assert client.post("/api/outbox/retry", json={"ids": ["1"]}).status_code == 400
    assert statuses(outbox_url) == {"pending": 2, "discarded": 1}
    audit = client.get("/api/audit").json()
    assert [(e["action"], e["actor"], e["count"], e["reason"]) for e in audit] == [
        ("outbox-discard", "loopback", 1, "sent by mistake"),
        ("outbox-retry", "loopback", 2, "queue bound now")]
    assert audit[0]["selection"]["outbox_ids"] == [ids["lost-2"]]
    assert audit[1]["selection"]["outbox_ids"] == sorted([ids["lost-1"], ids["late-1"]])
    assert audit[0]["selection"]["outbox"] == outbox_url
    listed = client.get("/api/outbox?status=discarded").json()["items"]
    assert [e["message_id"] for e in listed] == ["lost-2"]


def test_the_outbox_actions_take_the_desks_guard(
    tmp_path: Path, outbox_url: str, files: Path,
) -> None:
    ids = _dead_and_failed(outbox_url, files)
    for client, _store in _client(tmp_path, outbox_url, access_of(OPERATORS, tmp_path)):
        body = {"ids": [ids["lost-1"]], "reason": "no"}
        assert client.get("/api/outbox").status_code == 401
        viewer = ("vic", SECRETS["vic"])
        assert client.get("/api/outbox", auth=viewer).json()["total"] == 3  # a viewer reads
        for action in ("retry", "discard"):
            refused = client.post(f"/api/outbox/{action}", json=body, auth=viewer)
            assert refused.status_code == 403, refused.text
        forged = client.post("/api/outbox/retry", json=body, auth=("ana", SECRETS["ana"]),
                             headers={"Origin": "http://evil.example"})
        assert forged.status_code == 403
        # A browser session must send the page's CSRF token.
        login = client.post("/login", data={"name": "ana", "secret": SECRETS["ana"]})
        assert login.status_code in (200, 303), login.text
        assert client.post("/api/outbox/retry", json=body).status_code == 403
        token = client.cookies.get("rabbit_retry_csrf")
        assert token
        done = client.post("/api/outbox/retry", json=body, headers={"X-CSRF-Token": token})
        assert done.json() == {"retried": 1, "skipped": 0}
        assert client.get("/api/audit").json()[0]["actor"] == "ana"
    assert statuses(outbox_url) == {"pending": 1, "dead": 1, "failed": 1}


def test_without_an_outbox_its_routes_say_how_to_get_one(tmp_path: Path) -> None:
    for client, _store in _client(tmp_path, None):
        answer = client.get("/api/outbox")
        assert (answer.status_code, answer.json()["error"]) == (
            404, "this desk reads no outbox (rabbit-retry desk FILE --outbox URL)")
        assert client.post("/api/outbox/retry", json={"ids": [1]}).status_code == 404
        assert client.get("/api/overview").json()["outbox"] is None
        assert client.get("/api/me").json()["outbox"] is False


def _empty_database(path: Path) -> Path:
    sqlite3.connect(path).close()
    assert path.is_file()
    return path


def test_an_outbox_without_its_tables_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(BrokerError) as caught:
        open_outbox(f"sqlite:///{_empty_database(tmp_path / 'empty.db')}")
    assert str(caught.value).startswith("--outbox sqlite:///")
    assert "has no outbox tables; the desk reads revision 0002 (run `rabbit-retry relay`" \
        in str(caught.value)
    # No such file: said, and none made (connecting would make an empty database).
    with pytest.raises(InputError) as missing:
        open_outbox(f"sqlite:///{tmp_path / 'typo.db'}")
    assert str(missing.value) == f"--outbox sqlite:///{tmp_path / 'typo.db'}: no such file"
    assert not (tmp_path / "typo.db").exists()


def test_held_keys_name_the_parked_message_holding_each_and_since_when(
    desk: tuple[TestClient, Store],
) -> None:
    client, store = desk
    hold = {contract.ORDERED_HOLD: "h-1", contract.ORDERED_KEY: "customer-7"}
    store.insert([
        _parked(1, **hold),
        _parked(2),  # parked without holding (continue, or not ordered)
        _parked(3, **{contract.ORDERED_HOLD: "h-3", contract.ORDERED_KEY: "customer-9"}),
        _parked(4, queue="shop.mail", **{contract.ORDERED_HOLD: "h-4",
                                         contract.ORDERED_KEY: "<b>x</b>"}),
        _parked(5, **{contract.ORDERED_KEY: "customer-5"}),  # a key, no hold
    ])
    ids = {m["message_id"]: m["id"] for m in client.get("/api/messages").json()["items"]}
    held = client.get("/api/held").json()
    assert held["total"] == 3
    assert held["queues"] == [{"queue": "shop.mail", "held_keys": 1},
                              {"queue": "shop.orders", "held_keys": 2}]
    assert [(h["queue"], h["key"], h["hold"], h["message"], h["message_id"]) for h in
            held["items"]] == [
        ("shop.mail", "<b>x</b>", "h-4", ids["m-4"], "m-4"),
        ("shop.orders", "customer-7", "h-1", ids["m-1"], "m-1"),
        ("shop.orders", "customer-9", "h-3", ids["m-3"], "m-3")]
    assert held["items"][1]["since"] == "2026-11-01T00:01:00Z"
    assert client.get("/api/held?queue=shop.orders").json()["total"] == 2
    one = client.get("/api/held?queue=shop.orders&limit=1&offset=1").json()["items"]
    assert [h["key"] for h in one] == ["customer-9"]
    marks = {m["message_id"]: m["holds_key"]
             for m in client.get("/api/messages").json()["items"]}
    assert marks == {"m-1": "customer-7", "m-2": None, "m-3": "customer-9", "m-4": "<b>x</b>",
                     "m-5": None}
    # Discarded, it holds no more (its release is the desk's to send).
    assert client.post("/api/discard", json={"ids": [ids["m-1"]],
                                             "reason": "bad"}).status_code == 200
    assert [h["key"] for h in client.get("/api/held").json()["items"]] == ["<b>x</b>",
                                                                          "customer-9"]


def test_the_desk_command_says_in_one_line_what_is_wrong_with_its_outbox(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, files: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rabbit_retry.cli import main
    from rabbit_retry.errors import EXIT_INPUT, EXIT_RUNTIME

    monkeypatch.setenv("RABBIT_RETRY_DESK_TOKEN", "")
    monkeypatch.setenv("RABBIT_RETRY_DESK_ACCESS", "")
    store = tmp_path / "desk.db"
    empty = _empty_database(tmp_path / "empty.db")
    for args, code, line in (
        (["--outbox", "mysql://x/y"], EXIT_INPUT, "error: --outbox: unsupported database 'mysql'"),
        (["--outbox", f"sqlite:///{tmp_path / 'typo.db'}"], EXIT_INPUT,
         f"error: --outbox sqlite:///{tmp_path / 'typo.db'}: no such file"),
        (["--outbox", f"sqlite:///{empty}"], EXIT_RUNTIME,
         f"error: --outbox sqlite:///{empty}: has no outbox tables; the desk reads revision "),
    ):
        monkeypatch.delenv("RABBIT_RETRY_OUTBOX_STORE", raising=False)
        with pytest.raises(SystemExit) as exit_info:
            main(["desk", str(files), "--store", f"sqlite:///{store}", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == code, err
        assert err.startswith(line) and len(err.strip().splitlines()) == 1, err
    assert not store.exists()  # refused before the desk's own store was made
    # The relay's variable names the same database.
    monkeypatch.setenv("RABBIT_RETRY_OUTBOX_STORE", f"sqlite:///{empty}")
    with pytest.raises(SystemExit) as exit_info:
        main(["desk", str(files), "--store", f"sqlite:///{store}"])
    assert "has no outbox tables" in capsys.readouterr().err
    assert exit_info.value.code == EXIT_RUNTIME
