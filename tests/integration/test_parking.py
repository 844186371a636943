"""``rabbit-retry parking show|replay|purge|export`` on the real broker: every test counts the
messages and reads both queues back through the management API, an oracle independent of the
code under test."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from support.amqp import Outgoing, depth_sync, drain_sync, on_channel, publish_raw
from support.parked import Parked, Seen, look, park
from support.provision import provision

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

TOPOLOGY = """
version: 1
exchanges: {orders: {type: topic}}
queues:
  orders:
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [1h], max_attempts: 3}
"""

BINARY = bytes(range(256)) * 2
RICH_PROPERTIES: dict[str, Any] = {
    "content_type": "application/json",
    "content_encoding": "utf-8",
    # 4: a quorum queue on 4.x delivers by priority (4.0: 5 and above first; 4.3: also 0-3
    # after messages without one, which rank as 4), so any other value reorders the quorum
    # variant; test_quorum_parking_order_follows_priority shows it.
    "priority": 4,
    "correlation_id": "corr-3",
    "reply_to": "replies",
    "message_type": "order.created",
    "app_id": "shop",
    "user_id": "guest",
    "timestamp": dt.datetime(2024, 3, 1, 8, 30, tzinfo=dt.UTC),
}
THREE_DAYS_AGO = (dt.datetime.now(dt.UTC) - dt.timedelta(days=3)).isoformat(timespec="milliseconds")

# In the order they are parked: two KeyErrors (one with every property set), three
# ValueErrors (one binary), one invalid body parked three days ago.
MESSAGES = [
    Parked(b'{"order": 0}', "ValueError", message_id="m0"),
    Parked(b'{"order": 1}', "KeyError", "permanent", retry_count=1, message_id="m1",
           headers={"tenant": "acme"}),
    Parked(b'{"order": 2}', "ValueError", message_id="m2"),
    Parked(b'{"order": 3}', "KeyError", "permanent", retry_count=1, message_id="m3",
           properties=RICH_PROPERTIES),
    Parked(BINARY, "ValueError", message_id="m4"),
    Parked(b"not json", "JSONDecodeError", "invalid", retry_count=0, message_id="m5",
           parked_at=THREE_DAYS_AGO),
]
IDS = [m.message_id for m in MESSAGES]

Run = Callable[..., Any]


# Every verb runs on a classic parking queue and on a quorum one, as ``parking: {queue_type:
# quorum}`` declares it.
QUORUM_PARKING = TOPOLOGY + "    parking: {queue_type: quorum}\n"


@pytest.fixture(params=["classic", "quorum"])
def parked(fresh_vhost: Settings, request: pytest.FixtureRequest) -> Settings:
    asyncio.run(provision(fresh_vhost, QUORUM_PARKING if request.param == "quorum" else TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", MESSAGES))
    return fresh_vhost


def sent(headers: dict[str, Any] | None) -> dict[str, Any]:
    """Headers as published: without x-delivery-count, which the quorum main queue adds."""
    return {k: v for k, v in (headers or {}).items() if k != "x-delivery-count"}


def ids_of(seen: list[Seen]) -> list[str]:
    return [s.properties["message_id"] for s in seen]


def snapshot(seen: list[Seen]) -> list[tuple[bytes, dict[str, Any], dict[str, Any]]]:
    # A quorum queue counts each look (ours and the management API's) in these two.
    counted = ("x-delivery-count", "x-acquired-count")
    return [(s.body, {k: v for k, v in s.headers.items() if k not in counted}, s.properties)
            for s in seen]


def parking_of(api: Management, settings: Settings) -> list[Seen]:
    return look(api, settings, "orders.parking")


# --- show ---------------------------------------------------------------------------------------


def test_show_lists_every_message_and_leaves_them_parked_in_order_twice(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    before = parking_of(management, parked)
    assert ids_of(before) == IDS
    for _ in range(2):
        result = run_cli("parking", "show", "orders", "--json", settings=parked)
        assert result.code == 0, result.err
        data = json.loads(result.out)
        assert (data["queue"], data["main_queue"], data["parked"], data["shown"]) == (
            "orders.parking", "orders", 6, 6)
        assert [m["message_id"] for m in data["messages"]] == IDS
        assert [m["position"] for m in data["messages"]] == [1, 2, 3, 4, 5, 6]
        assert depth_sync(parked, "orders.parking") == 6
        assert snapshot(parking_of(management, parked)) == snapshot(before)
    second = data["messages"][1]
    assert second == {
        "position": 2,
        "message_id": "m1",
        "message_id_generated": False,
        "correlation_id": None,
        "parked_at": second["parked_at"],
        "reason": "permanent",
        "exception_type": "KeyError",
        "exception_message": "KeyError on b'{\"order\": 1}'",
        "attempts": 1,
        "replay_count": 0,
        "original_exchange": "orders",
        "original_routing_key": "order.created",
        "original_queue": "orders",
        "body_bytes": 12,
        "body_preview": '{"order": 1}',
    }
    assert data["messages"][4]["body_preview"].startswith("<binary, 512 bytes> 000102")
    assert data["groups"] == {
        "by_cause": [
            {"exception_type": "ValueError", "reason": "exhausted", "count": 3},
            {"exception_type": "KeyError", "reason": "permanent", "count": 2},
            {"exception_type": "JSONDecodeError", "reason": "invalid", "count": 1},
        ],
        "by_reason": {"exhausted": 3, "permanent": 2, "invalid": 1},
        "by_exception_type": {"ValueError": 3, "KeyError": 2, "JSONDecodeError": 1},
    }


def test_show_as_a_table_with_the_counts_by_cause(parked: Settings, run_cli: Run) -> None:
    result = run_cli("parking", "show", "orders.parking", settings=parked)
    assert result.code == 0, result.err
    lines = [line.rstrip() for line in result.out.splitlines()]
    assert lines[0] == "orders.parking: 6 parked messages"
    row = next(line for line in lines if " m1 " in line)
    for cell in ("permanent", "KeyError: KeyError on b'{\"order\": 1}'", "order.created",
                 '{"order": 1}'):
        assert cell in row
    assert "<binary, 512 bytes>" in next(line for line in lines if " m4 " in line)
    assert "by cause, all: 3 exhausted, 2 permanent, 1 invalid" in lines
    assert any(line.split("│") == ["    3 ", " ValueError      ", " exhausted"]
               for line in lines), lines


def test_show_group_and_limit(parked: Settings, run_cli: Run, management: Management) -> None:
    before = snapshot(parking_of(management, parked))
    result = run_cli("parking", "show", "orders", "--limit", "2", "--json", settings=parked)
    data = json.loads(result.out)
    assert (data["parked"], data["shown"]) == (6, 2)
    assert [m["message_id"] for m in data["messages"]] == ["m0", "m1"]

    result = run_cli("parking", "show", "orders", "--group", settings=parked)
    assert result.code == 0, result.err
    assert " m0 " not in result.out
    assert "by cause, all: 3 exhausted, 2 permanent, 1 invalid" in result.out

    result = run_cli("parking", "show", "orders", "--group", "--json", "--limit", "3",
                     settings=parked)
    data = json.loads(result.out)
    assert "messages" not in data
    assert data["groups"]["by_reason"] == {"exhausted": 2, "permanent": 1}
    assert snapshot(parking_of(management, parked)) == before


def test_show_an_empty_parking_queue(fresh_vhost: Settings, run_cli: Run) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    result = run_cli("parking", "show", "orders", settings=fresh_vhost)
    assert (result.code, result.out) == (0, "orders.parking is empty: nothing is parked.\n")


# --- replay -------------------------------------------------------------------------------------


def test_replay_where_moves_exactly_the_matching_ones_with_reset_headers(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    before = parking_of(management, parked)
    result = run_cli("parking", "replay", "orders", "--where", "exception-type=KeyError",
                     "--yes", settings=parked)
    assert result.code == 0, result.err
    assert result.out == ("replayed 2 of 6 parked messages from 'orders.parking' to 'orders' "
                          "(exception-type=KeyError); 4 left parked\n")

    # the others stay parked, untouched, in their order
    after = parking_of(management, parked)
    assert ids_of(after) == ["m0", "m2", "m4", "m5"]
    assert snapshot(after) == [s for s in snapshot(before) if s[2]["message_id"] in ids_of(after)]

    moved = drain_sync(parked, "orders")
    assert [m.message_id for m in moved] == ["m1", "m3"]
    assert [m.body for m in moved] == [b'{"order": 1}', b'{"order": 3}']
    assert sent(moved[0].headers) == {
        "original-exchange": "orders",
        "original-routing-key": "order.created",
        "tenant": "acme",
        "replay-count": 1,
    }
    rich = moved[1]
    assert sent(rich.headers) == {"original-exchange": "orders",
                            "original-routing-key": "order.created", "replay-count": 1}
    assert (rich.content_type, rich.content_encoding, rich.priority, rich.correlation_id,
            rich.reply_to, rich.message_type, rich.app_id, rich.user_id, rich.timestamp,
            rich.delivery_mode) == (
        "application/json", "utf-8", 4, "corr-3", "replies", "order.created", "shop", "guest",
        RICH_PROPERTIES["timestamp"], 2)


def test_replayed_again_after_parking_again_counts_two(
    fresh_vhost: Settings, run_cli: Run
) -> None:
    # What the worker does when a replayed message fails again: parks it keeping replay-count.
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", [Parked(b"again", message_id="a")]))
    assert run_cli("parking", "replay", "orders", "--yes", settings=fresh_vhost).code == 0
    (first,) = drain_sync(fresh_vhost, "orders")
    assert first.headers["replay-count"] == 1
    asyncio.run(park(fresh_vhost, "orders", [Parked(first.body, message_id="a",
                                                   headers=sent(first.headers))]))
    result = run_cli("parking", "replay", "orders.parking", "--yes", settings=fresh_vhost)
    assert result.out.startswith("replayed 1 of 1 parked message from 'orders.parking'")
    (second,) = drain_sync(fresh_vhost, "orders")
    assert (second.body, second.headers["replay-count"]) == (b"again", 2)
    assert "retry-count" not in second.headers and "x-death" not in second.headers
    assert depth_sync(fresh_vhost, "orders.parking") == 0


def test_replay_handle_again_marks_the_copies_and_the_next_replay_drops_the_mark(
    fresh_vhost: Settings, run_cli: Run
) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", [Parked(b"x", message_id="a")]))
    result = run_cli("parking", "replay", "orders", "--handle-again", "--yes",
                     settings=fresh_vhost)
    assert result.code == 0, result.err
    (marked,) = drain_sync(fresh_vhost, "orders")
    assert (marked.message_id, marked.headers["handle-again"]) == ("a", True)
    # Published as the replayer's own user, which the broker checked: what a worker trusts.
    assert marked.properties.user_id == fresh_vhost.user
    # Parked again and replayed without the flag: the mark does not stick.
    asyncio.run(park(fresh_vhost, "orders", [Parked(b"x", message_id="a",
                                                   headers=sent(marked.headers))]))
    assert run_cli("parking", "replay", "orders", "--yes", settings=fresh_vhost).code == 0
    (plain,) = drain_sync(fresh_vhost, "orders")
    assert "handle-again" not in plain.headers and plain.headers["replay-count"] == 2


def test_replay_limit_takes_the_first_matching_ones(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    result = run_cli("parking", "replay", "orders", "--where", "exception-type=ValueError",
                     "--where", "parked-reason=exhausted", "--limit", "2", "--yes",
                     settings=parked)
    assert result.code == 0, result.err
    assert result.out == ("replayed 2 of 6 parked messages from 'orders.parking' to 'orders' "
                          "(exception-type=ValueError and parked-reason=exhausted); 4 left "
                          "parked\n")
    assert [m.message_id for m in drain_sync(parked, "orders")] == ["m0", "m2"]
    assert ids_of(parking_of(management, parked)) == ["m1", "m3", "m4", "m5"]


def test_replay_with_nothing_matching_changes_nothing(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    before = snapshot(parking_of(management, parked))
    result = run_cli("parking", "replay", "orders", "--where", "tenant=nobody", "--yes",
                     settings=parked)
    assert result.out.startswith("replayed 0 of 6 parked messages")
    assert result.out.endswith("; 6 left parked\n")
    assert snapshot(parking_of(management, parked)) == before
    assert depth_sync(parked, "orders") == 0


def test_replay_when_the_main_queue_is_gone_refuses_and_keeps_everything(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    path = f"/queues/{quote(parked.vhost, safe='')}/orders"
    assert management.request("DELETE", path).status_code == 204
    result = run_cli("parking", "replay", "orders", "--yes", settings=parked)
    assert result.code == 2
    assert result.err == (f"error: queue 'orders' does not exist in vhost {parked.vhost!r}: "
                          "replay would have nowhere to send the messages\n")
    assert ids_of(parking_of(management, parked)) == IDS


# --- purge --------------------------------------------------------------------------------------


def test_purge_where_deletes_exactly_the_matching_ones(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    before = snapshot(parking_of(management, parked))
    result = run_cli("parking", "purge", "orders", "--where", "parked-reason=permanent", "--yes",
                     settings=parked)
    assert result.code == 0, result.err
    assert result.out == ("deleted 2 of 6 parked messages from 'orders.parking' "
                          "(parked-reason=permanent); 4 left parked\n")
    after = parking_of(management, parked)
    assert ids_of(after) == ["m0", "m2", "m4", "m5"]
    assert snapshot(after) == [s for s in before if s[2]["message_id"] in ids_of(after)]
    assert depth_sync(parked, "orders") == 0  # deleted, not moved


def test_purge_older_than_uses_parked_at(
    parked: Settings, run_cli: Run, management: Management
) -> None:
    result = run_cli("parking", "purge", "orders", "--older-than", "2d", "--yes",
                     settings=parked)
    assert result.out == ("deleted 1 of 6 parked messages from 'orders.parking' (parked more "
                          "than 2d ago); 5 left parked\n")
    assert ids_of(parking_of(management, parked)) == ["m0", "m1", "m2", "m3", "m4"]
    result = run_cli("parking", "purge", "orders", "--older-than", "1h", "--where",
                     "exception-type=KeyError", "--yes", settings=parked)
    assert result.out.startswith("deleted 0 of 5 parked messages")
    assert ids_of(parking_of(management, parked)) == ["m0", "m1", "m2", "m3", "m4"]


def test_purge_without_a_filter_deletes_everything_that_was_parked(
    parked: Settings, run_cli: Run
) -> None:
    result = run_cli("parking", "purge", "orders.parking", "--yes", settings=parked)
    assert result.out == "deleted 6 of 6 parked messages from 'orders.parking' (all); 0 left " \
                         "parked\n"
    assert depth_sync(parked, "orders.parking") == 0
    assert depth_sync(parked, "orders.parking") is not None  # the queue itself stays


# --- export -------------------------------------------------------------------------------------


def test_export_is_complete_and_leaves_everything_parked(
    parked: Settings, run_cli: Run, management: Management, tmp_path: Path
) -> None:
    before = snapshot(parking_of(management, parked))
    out = tmp_path / "parked.jsonl"
    result = run_cli("parking", "export", "orders", "--out", str(out), settings=parked)
    assert result.code == 0, result.err
    assert result.err == (f"exported 6 parked messages from 'orders.parking' to {out}; "
                          "they stay parked\n")
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["properties"]["message_id"] for r in records] == IDS
    bodies = [base64.b64decode(r["body"]) if r["body_encoding"] == "base64"
              else r["body"].encode() for r in records]
    assert bodies == [m.body for m in MESSAGES]
    assert [r["body_encoding"] for r in records] == ["utf-8"] * 4 + ["base64", "utf-8"]
    rich = records[3]
    assert rich["properties"] == {**{k: v for k, v in RICH_PROPERTIES.items()
                                     if k != "timestamp"},
                                  "timestamp": "2024-03-01T08:30:00+00:00",
                                  "delivery_mode": 2, "message_id": "m3"}
    assert rich["headers"]["parked-reason"] == "permanent"
    assert rich["headers"]["x-death"][0]["queue"] == "orders"
    assert records[1]["headers"]["tenant"] == "acme"
    assert snapshot(parking_of(management, parked)) == before
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind


def test_a_replay_right_after_an_export_and_a_show_sees_every_parked_message(
    fresh_vhost: Settings, run_cli: Run, tmp_path: Path
) -> None:
    """Looking puts every message back before the verb returns, so the next verb counts them
    all. (A report had a replay right after an export see a fraction of 20,000; this machine
    never showed that race, with 20,000 either: the check guards the behaviour, the passive
    declare after the requeue in ``ParkingQueue.requeue_rest`` closes the window.)"""
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    many = 3000
    asyncio.run(park(fresh_vhost, "orders", [Parked(b'{"n": 1}', "ValueError")] * many))
    out = tmp_path / "all.jsonl"
    assert run_cli("parking", "export", "orders", "--out", str(out), settings=fresh_vhost).code == 0
    assert run_cli("parking", "show", "orders", "--limit", "3000", settings=fresh_vhost).code == 0
    result = run_cli("parking", "replay", "orders", "--yes", settings=fresh_vhost)
    assert result.code == 0, result.err
    assert result.out.startswith(f"replayed {many} of {many} parked messages"), result.out
    assert depth_sync(fresh_vhost, "orders") == many


def test_export_to_stdout(parked: Settings, run_cli: Run) -> None:
    result = run_cli("parking", "export", "orders", "--out", "-", settings=parked)
    assert [json.loads(line)["position"] for line in result.out.splitlines()] == list(range(1, 7))


def test_export_into_a_missing_directory_is_refused(
    parked: Settings, run_cli: Run, tmp_path: Path
) -> None:
    result = run_cli("parking", "export", "orders", "--out", str(tmp_path / "no" / "x.jsonl"),
                     settings=parked)
    assert result.code == 2
    assert result.err == (f"error: --out {tmp_path / 'no' / 'x.jsonl'}: directory "
                          f"{str(tmp_path / 'no')!r} does not exist\n")


# --- confirmation and errors --------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["replay", "purge"])
def test_without_yes_and_without_a_terminal_nothing_changes(
    parked: Settings, run_cli: Run, management: Management, verb: str
) -> None:
    before = snapshot(parking_of(management, parked))
    result = run_cli("parking", verb, "orders", settings=parked)
    assert result.code == 2
    assert result.err == (f"error: refusing to {verb} without confirmation: stdin is not a "
                          "terminal; pass --yes\n")
    assert result.out == ""
    assert snapshot(parking_of(management, parked)) == before
    assert depth_sync(parked, "orders") == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "queue 'nope.parking' does not exist in vhost {vhost!r}: is 'nope' a queue of "
                 "a topology applied to this vhost?"),
        ("nope.parking", "queue 'nope.parking' does not exist in vhost {vhost!r}"),
    ],
)
@pytest.mark.parametrize("verb", [("show",), ("replay", "--yes"), ("purge", "--yes"),
                                  ("export", "--out", "-")])
def test_an_unknown_queue_is_one_line_and_exit_2(
    fresh_vhost: Settings, run_cli: Run, name: str, message: str, verb: tuple[str, ...]
) -> None:
    result = run_cli("parking", verb[0], name, *verb[1:], settings=fresh_vhost)
    assert (result.code, result.out) == (2, "")
    assert result.err == f"error: {message.format(vhost=fresh_vhost.vhost)}\n"


def test_bad_filters_are_exit_2(parked: Settings, run_cli: Run) -> None:
    result = run_cli("parking", "purge", "orders", "--where", "tenant", "--yes", settings=parked)
    assert (result.code, result.err) == (
        2, "error: --where: expected HEADER=VALUE (e.g. exception-type=TimeoutError), got "
           "'tenant'\n")
    result = run_cli("parking", "purge", "orders", "--older-than", "soon", "--yes",
                     settings=parked)
    assert (result.code, result.err) == (
        2, "error: --older-than: bad duration 'soon': use a positive whole number with ms, s, "
           "m, h or d (90m, 2d)\n")
    assert depth_sync(parked, "orders.parking") == 6


def test_an_unreachable_broker_is_exit_1(run_cli: Run) -> None:
    down = Settings("amqp://guest:secret@127.0.0.1:1/", "http://guest:secret@127.0.0.1:1")
    result = run_cli("parking", "show", "orders", settings=down)
    assert result.code == 1
    assert "error: broker at amqp://guest:***@127.0.0.1:1/ is unreachable" in result.err
    assert "secret" not in result.err + result.out


def test_a_quorum_parking_queue_a_look_could_empty_is_refused(
    fresh_vhost: Settings, run_cli: Run, management: Management
) -> None:
    # Declared by hand as quorum without a limit: a look requeues every message, and 4.x quorum
    # queues drop a message after 20 returns, so rabbit-retry will not read it.
    asyncio.run(on_channel(fresh_vhost, lambda ch: ch.queue_declare(
        "jobs.parking", durable=True, arguments={"x-queue-type": "quorum"})))
    asyncio.run(park(fresh_vhost, "jobs", [Parked(b"x", message_id="j")]))
    result = run_cli("parking", "show", "jobs", settings=fresh_vhost)
    assert result.code == 3
    assert result.err == (
        "error: 'jobs.parking' is a quorum queue with no x-delivery-limit: every look at a "
        "message counts toward the limit past which the broker drops it; declare it with "
        "rabbit-retry apply (parking: {queue_type: quorum}), which sets a limit no look can "
        "reach\n")
    assert [s.properties["message_id"] for s in look(management, fresh_vhost, "jobs.parking")] \
        == ["j"]


MANY = [Parked(b"%d" % i, message_id=f"n{i}") for i in range(100)]


def test_a_quorum_parking_queue_keeps_its_order_through_partial_looks_and_replays(
    fresh_vhost: Settings, run_cli: Run
) -> None:
    # 100 messages: a quorum queue shuffles more than 32 requeued at once, and puts a requeued
    # head behind what it handed out before; neither may show.
    asyncio.run(provision(fresh_vhost, QUORUM_PARKING))
    asyncio.run(park(fresh_vhost, "orders", MANY))
    every = [m.message_id for m in MANY]

    def shown(*args: str) -> list[str]:
        result = run_cli("parking", "show", "orders", "--json", *args, settings=fresh_vhost)
        assert result.code == 0, result.err
        return [m["message_id"] for m in json.loads(result.out)["messages"]]

    for _ in range(3):
        assert shown() == every
    assert shown("--limit", "7") == every[:7]
    assert shown() == every
    assert shown("--limit", "40") == every[:40]
    # a replay of the first ten leaves the other ninety in their order
    result = run_cli("parking", "replay", "orders", "--limit", "10", "--yes",
                     settings=fresh_vhost)
    assert result.code == 0, result.err
    assert shown() == every[10:]
    assert [m.message_id for m in drain_sync(fresh_vhost, "orders")] == every[:10]


def test_quorum_parking_order_follows_priority(
    fresh_vhost: Settings, run_cli: Run, management: Management
) -> None:
    # What the broker does, not rabbit-retry: parked copies keep the priority property, and a
    # quorum queue hands out higher priorities first on 4.x (3.10 ignores it).
    asyncio.run(provision(fresh_vhost, QUORUM_PARKING))
    asyncio.run(park(fresh_vhost, "orders", [
        Parked(b"a", message_id="plain"),
        Parked(b"b", message_id="high", properties={"priority": 9}),
    ]))
    result = run_cli("parking", "show", "orders", "--json", settings=fresh_vhost)
    assert result.code == 0, result.err
    ids = [m["message_id"] for m in json.loads(result.out)["messages"]]
    major = int(str(management.get("/overview")["rabbitmq_version"]).split(".")[0])
    assert ids == (["high", "plain"] if major >= 4 else ["plain", "high"])


def test_a_replay_the_main_queue_refuses_stops_and_keeps_the_rest_parked(
    fresh_vhost: Settings, run_cli: Run, management: Management
) -> None:
    # A main queue with room for one more message: the second copy is nacked by the broker.
    asyncio.run(on_channel(
        fresh_vhost,
        lambda ch: ch.queue_declare("cap", durable=True, arguments={
            "x-queue-type": "classic", "x-max-length": 1, "x-overflow": "reject-publish"}),
        lambda ch: ch.queue_declare("cap.parking", durable=True,
                                    arguments={"x-queue-type": "classic"}),
    ))
    asyncio.run(park(fresh_vhost, "cap", [Parked(b"%d" % i, message_id=f"c{i}")
                                          for i in range(3)]))
    result = run_cli("parking", "replay", "cap", "--yes", settings=fresh_vhost)
    assert result.code == 1
    assert result.err == ("error: replay stopped after 1 of 3 parked messages in 'cap.parking': "
                          "the broker refused the copy of parked message #2 (publisher nack; is "
                          "'cap' full?); it stays parked\n")
    assert [m.message_id for m in drain_sync(fresh_vhost, "cap")] == ["c0"]
    assert [s.properties["message_id"] for s in look(management, fresh_vhost, "cap.parking")] \
        == ["c1", "c2"]


def test_a_replay_keeps_doubles_and_binary_headers_exactly(
    fresh_vhost: Settings, run_cli: Run
) -> None:
    # pamqp's own encoder writes every float as a 32-bit float and refuses bytes; replays go
    # through the exact encoder (rabbit_retry.wire), as retry and parked copies do.
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    headers = {"ratio": 0.1, "raw": b"\xff\xfe", "parked-reason": "exhausted", "retry-count": 3}
    asyncio.run(publish_raw(fresh_vhost, [Outgoing("d", b"{}", headers).wire()],
                            routing_key="orders.parking"))
    result = run_cli("parking", "replay", "orders", "--yes", settings=fresh_vhost)
    assert result.code == 0, result.err
    (replayed,) = drain_sync(fresh_vhost, "orders")
    assert replayed.headers["ratio"] == 0.1  # a 32-bit float would read 0.10000000149011612
    assert replayed.headers["raw"] == b"\xff\xfe"
    assert "retry-count" not in replayed.headers
