"""The parking verbs' pure core: replay headers, filters, views of a parked message, pacing,
name resolution. No broker."""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Decimal

import pytest
from rich.console import Console

from rabbit_retry.contract import ORIGINAL_QUEUE
from rabbit_retry.parking import headers as parking_headers
from rabbit_retry.parking.act import Pacer
from rabbit_retry.parking.filters import Selection, Where, parse_age, parse_where, selection
from rabbit_retry.parking.message import (
    ParkedMessage,
    body_fields,
    decode_body,
    export_record,
    group,
    jsonable,
    preview,
    summary_record,
)
from rabbit_retry.parking.render import messages_table
from rabbit_retry.parking.session import Target, candidates

NOW = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)

PARKED = {
    "x-death": [{"count": 2, "reason": "rejected", "queue": "orders"}],
    "x-first-death-reason": "rejected",
    "x-first-death-queue": "orders",
    "x-first-death-exchange": "orders",
    "x-last-death-reason": "rejected",
    "x-last-death-queue": "orders",
    "x-last-death-exchange": "orders",
    "x-delivery-count": 4,
    "parked-reason": "exhausted",
    "parked-at": "2024-05-01T10:00:00.000Z",
    "retry-count": 3,
    "exception-type": "TimeoutError",
    "exception-message": "upstream slow",
    "exception-stacktrace": "Traceback ...",
    "original-exchange": "orders",
    "original-routing-key": "order.created",
    "original-queue": "orders",
    "tenant": "acme",
}


# --- replay headers -----------------------------------------------------------------------------


def test_replay_strips_parking_and_death_headers_and_counts_the_replay() -> None:
    assert parking_headers.replay_headers(PARKED) == {
        "original-exchange": "orders",
        "original-routing-key": "order.created",
        "tenant": "acme",
        "replay-count": 1,
    }


def test_replay_count_increments_and_the_input_is_left_alone() -> None:
    before = {**PARKED, "replay-count": 1}
    assert parking_headers.replay_headers(before)["replay-count"] == 2
    assert before["replay-count"] == 1 and "x-death" in before


@pytest.mark.parametrize("garbled", ["two", -1, True, None, 1.5e300 * 1e10, b"\xff"])
def test_a_garbled_replay_count_counts_as_zero(garbled: object) -> None:
    assert parking_headers.replay_headers({"replay-count": garbled})["replay-count"] == 1


def test_replay_count_written_as_text_or_bytes_still_counts() -> None:
    assert parking_headers.replay_headers({"replay-count": "2"})["replay-count"] == 3
    assert parking_headers.replay_headers({"replay-count": b"4"})["replay-count"] == 5
    assert parking_headers.replay_headers(None) == {"replay-count": 1}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2024-05-01T10:00:00.000Z", dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)),
        ("2024-05-01T12:00:00+02:00", dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)),
        ("2024-05-01T10:00:00", dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)),  # naive is UTC
        (b"2024-05-01T10:00:00Z", dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)),
        (dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC), dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)),
        ("yesterday", None),
        ("", None),
        (None, None),
        (17, None),
    ],
)
def test_parked_at(value: object, expected: dt.datetime | None) -> None:
    assert parking_headers.parked_at({"parked-at": value}) == expected


# --- filters ------------------------------------------------------------------------------------


def test_parse_where_splits_at_the_first_equals_sign() -> None:
    assert parse_where("exception-message=a=b") == Where("exception-message", "a=b")
    assert parse_where("tenant=") == Where("tenant", "")


@pytest.mark.parametrize("bad", ["tenant", "=acme", "  =x"])
def test_parse_where_rejects_what_is_not_header_equals_value(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HEADER=VALUE"):
        parse_where(bad)


def test_where_compares_as_text_and_all_must_hold() -> None:
    both = selection(["retry-count=3", "exception-type=TimeoutError"])
    assert both.matches(PARKED)
    assert not selection(["retry-count=3", "exception-type=KeyError"]).matches(PARKED)
    assert not selection(["missing-header=x"]).matches(PARKED)
    assert selection([]).matches({})


def test_older_than_uses_parked_at_and_never_matches_an_undated_message() -> None:
    older = selection(older_than="1h", now=NOW)  # cutoff 11:00; parked 10:00
    assert older.matches(PARKED)
    assert not selection(older_than="3h", now=NOW).matches(PARKED)
    assert not older.matches({**PARKED, "parked-at": "garbage"})
    assert not older.matches({k: v for k, v in PARKED.items() if k != "parked-at"})


# Parked by the broker (on_full / on_expire: park): no parking headers, the reason and the time
# in the newest x-death entry.
BROKER_PARKED = {
    "x-death": [
        {"count": 1, "reason": "maxlen", "queue": "orders",
         "time": dt.datetime(2024, 5, 1, 9, 0, tzinfo=dt.UTC)},
        {"count": 1, "reason": "expired", "queue": "orders.retry.5s",
         "time": dt.datetime(2024, 5, 1, 8, 0, tzinfo=dt.UTC)},
    ],
    "tenant": "acme",
}


def test_a_message_the_broker_parked_is_selected_by_its_reason_and_dated_by_its_death() -> None:
    assert selection(["parked-reason=queue-full"]).matches(BROKER_PARKED)
    assert not selection(["parked-reason=expired"]).matches(BROKER_PARKED)  # the newest counts
    assert selection(older_than="2h", now=NOW).matches(BROKER_PARKED)  # parked 9:00
    assert not selection(older_than="4h", now=NOW).matches(BROKER_PARKED)
    # rabbit-retry's own parked copy: its parked-reason and parked-at, whatever x-death says.
    assert selection(["parked-reason=exhausted"]).matches(PARKED)
    assert not selection(["parked-reason=rejected"]).matches(PARKED)
    assert parking_headers.parked_at({**BROKER_PARKED, "x-death": [
        {"reason": "rejected-by-someone", "time": NOW}]}) is None  # not a parking death


def test_older_than_exactly_at_the_cutoff_is_not_older() -> None:
    assert not selection(older_than="2h", now=NOW).matches(PARKED)


def test_parse_age_has_no_ttl_ceiling() -> None:
    assert parse_age("90d") == 90 * 86_400_000
    assert parse_age("250ms") == 250
    for bad in ("0s", "5x", "1.5h", "", "-1h"):
        with pytest.raises(ValueError, match="--older-than: bad duration"):
            parse_age(bad)


def test_selection_errors_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"^--where: "):
        selection(["nope"])
    with pytest.raises(ValueError, match=r"^--older-than: "):
        selection(older_than="soon")


def test_describe() -> None:
    assert Selection().describe() == "all"
    assert Selection().everything
    described = selection(["a=1", "b=2"], "2d", NOW).describe()
    assert described == "a=1 and b=2 and parked more than 2d ago"


# --- views of a parked message ------------------------------------------------------------------


def test_preview_escapes_control_characters_and_truncates() -> None:
    assert preview(b'{"a":\n1}') == '{"a":\\n1}'
    assert preview(b"x" * 100, 10) == "x" * 9 + "…"
    assert preview("é".encode()) == "é"


def test_preview_of_binary_is_hex_with_the_size() -> None:
    assert preview(bytes([0, 255, 1])) == "<binary, 3 bytes> 00ff01"
    assert preview(b"\xff" * 50, 30) == "<binary, 50 bytes> " + "ff" * 10 + "…"


@pytest.mark.parametrize("body", [b"", b"plain", "ünïcode".encode(), bytes(range(256)),
                                  b"\x00\x01", b"\xff"])
def test_body_round_trips_through_an_export_line(body: bytes) -> None:
    fields = json.loads(json.dumps(body_fields(body)))
    assert decode_body(fields) == body
    assert fields["body_encoding"] == ("utf-8" if body != bytes(range(256))
                                       and body != b"\xff" else "base64")


def test_jsonable_keeps_types_json_has_and_describes_the_rest() -> None:
    value = {"s": "x", "i": 1, "b": True, "f": 1.5, "n": None, "bytes": b"ok",
             "bin": b"\xff\x00", "t": NOW, "d": Decimal("2.5"), "l": [b"a", {"x": NOW}],
             "inf": float("inf")}
    assert jsonable(value) == {
        "s": "x", "i": 1, "b": True, "f": 1.5, "n": None, "bytes": "ok",
        "bin": {"base64": base64.b64encode(b"\xff\x00").decode()},
        "t": "2024-05-01T12:00:00+00:00", "d": "2.5",
        "l": ["a", {"x": "2024-05-01T12:00:00+00:00"}],
        "inf": "inf",
    }


def _message(position: int = 1, **headers: object) -> ParkedMessage:
    return ParkedMessage(position, b'{"order": 7}', {**PARKED, **headers},
                         {"message_id": "m-7", "delivery_mode": 2, "timestamp": NOW})


def test_summary_record_is_what_show_json_prints() -> None:
    assert summary_record(_message()) == {
        "position": 1,
        "message_id": "m-7",
        "message_id_generated": False,
        "correlation_id": None,
        "parked_at": "2024-05-01T10:00:00.000Z",
        "reason": "exhausted",
        "exception_type": "TimeoutError",
        "exception_message": "upstream slow",
        "attempts": 3,
        "replay_count": 0,
        "original_exchange": "orders",
        "original_routing_key": "order.created",
        "original_queue": "orders",
        "body_bytes": 12,
        "body_preview": '{"order": 7}',
    }


def test_a_header_as_text_or_none() -> None:
    message = _message(**{"original-queue": b"orders"})
    assert message.header(ORIGINAL_QUEUE) == "orders"  # AMQP bytes read as text
    assert message.header("no-such-header") is None


def test_export_record_has_properties_headers_and_body() -> None:
    record = json.loads(json.dumps(export_record(_message())))
    assert record["properties"] == {"message_id": "m-7", "delivery_mode": 2,
                                    "timestamp": "2024-05-01T12:00:00+00:00"}
    assert record["headers"]["tenant"] == "acme"
    assert record["headers"]["x-death"] == [{"count": 2, "reason": "rejected", "queue": "orders"}]
    assert (record["body"], record["body_encoding"]) == ('{"order": 7}', "utf-8")


def test_group_counts_by_cause_largest_first() -> None:
    messages = [
        _message(1),
        _message(2, **{"exception-type": "KeyError", "parked-reason": "permanent"}),
        _message(3),
        _message(4, **{"exception-type": None, "parked-reason": "invalid"}),
    ]
    groups = group(messages)
    assert groups.by_cause == (("TimeoutError", "exhausted", 2), ("(none)", "invalid", 1),
                               ("KeyError", "permanent", 1))
    assert groups.by_reason == (("exhausted", 2), ("invalid", 1), ("permanent", 1))
    assert groups.to_json()["by_exception_type"] == {"TimeoutError": 2, "(none)": 1,
                                                     "KeyError": 1}
    assert group([]).by_cause == ()


# --- resolving Q and copying properties ---------------------------------------------------------


def test_candidates_try_the_main_queue_first() -> None:
    assert candidates("orders") == [Target("orders", "orders.parking")]
    assert candidates("orders.parking") == [
        Target("orders.parking", "orders.parking.parking"),
        Target("orders", "orders.parking"),
    ]


# --- pacing -------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds


async def test_pacer_spreads_actions_evenly() -> None:
    clock = FakeClock()
    pacer = Pacer(4, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        await pacer.wait()
    assert clock.sleeps == [0.25, 0.25, 0.25]
    assert clock.now == pytest.approx(100.75)


async def test_pacer_does_not_burst_after_a_slow_stretch() -> None:
    clock = FakeClock()
    pacer = Pacer(10, clock=clock, sleep=clock.sleep)
    await pacer.wait()
    clock.now += 5  # the broker was slow
    await pacer.wait()
    await pacer.wait()
    assert clock.sleeps == [0.1]


async def test_pacer_without_rate_never_sleeps() -> None:
    clock = FakeClock()
    pacer = Pacer(None, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        await pacer.wait()
    assert clock.sleeps == []
    with pytest.raises(ValueError):
        Pacer(0)


def test_a_message_without_its_own_id_is_shown_by_its_correlation_id() -> None:
    """A Celery task has no message_id (its id is the correlation_id): the id a copy got is
    marked as made up, and the correlation id is shown, in the table and in --json."""
    celery = ParkedMessage(1, b"{}", {**PARKED, "message-id-generated": True},
                           {"message_id": "3f2a", "correlation_id": "task-42"})
    plain = _message(2)
    assert summary_record(celery)["message_id_generated"] is True
    assert summary_record(celery)["correlation_id"] == "task-42"
    console = Console(width=200, record=True)
    console.print(messages_table([celery, plain]))
    lines = console.export_text().splitlines()
    assert "correlation id" in lines[0]
    assert "3f2a (generated)" in lines[2] and "task-42" in lines[2]
    assert "m-7" in lines[3] and "generated" not in lines[3]
    # Without any correlation id the table keeps its usual columns.
    console = Console(width=200, record=True)
    console.print(messages_table([plain]))
    assert "correlation id" not in console.export_text()


def test_a_header_name_that_is_not_utf8_reads_as_replacement_characters() -> None:
    # wire decodes such a name with surrogateescape; JSON stores refuse lone surrogates.
    assert jsonable({"\udcff\udcfe": 1, "ok": {"\udcff": 2}}) == {
        "\ufffd\ufffd": 1, "ok": {"\ufffd": 2}}
