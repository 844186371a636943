"""Headers of retry and parked copies: what is kept, dropped, added and how much an exception
may take; and the header encoding that keeps every decoded value intact."""

from __future__ import annotations

import datetime
import decimal
from typing import Any

import pytest
from aiormq import spec
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import decode as pamqp_decode
from pamqp import header as pamqp_header

from rabbit_retry.contract import copy_properties
from rabbit_retry.wire import decode_table, encode_table, encoded_size
from rabbit_retry.worker import copies
from rabbit_retry.worker.consumer import Permanent

NOW = datetime.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)
BROKER = {
    "x-death": [{"queue": "q", "reason": "rejected", "count": 1}],
    "x-first-death-queue": "q",
    "x-first-death-reason": "rejected",
    "x-first-death-exchange": "orders",
    "x-last-death-queue": "q",
    "x-last-death-reason": "rejected",
    "x-last-death-exchange": "orders",
    "x-delivery-count": 2,
}


def test_retry_copy_drops_broker_bookkeeping_and_sets_retry_count() -> None:
    headers = copies.retry_headers(
        {"tenant": "acme", "retry-count": 1, **BROKER},
        retry_count=2,
        original=("orders", "order.created"),
    )
    assert headers == {
        "tenant": "acme",
        "retry-count": 2,
        "original-exchange": "orders",
        "original-routing-key": "order.created",
    }


def test_retry_copy_writes_the_source_the_history_believed() -> None:
    """The caller passes where the message was first published as ``history`` read it; a
    publisher's own ``original-*`` headers are replaced, never carried on."""
    headers = copies.retry_headers(
        {"original-exchange": "evil", "original-routing-key": "evil.rk"},
        retry_count=3,
        original=("billing", "x"),
        expiration="60000",
    )
    assert headers["original-exchange"] == "billing"
    assert headers["original-routing-key"] == "x"
    assert headers["original-expiration"] == "60000"


def test_retry_copy_says_what_failed_the_attempt_before_and_forgets_older_failures() -> None:
    failure = copies.Failure("app.GatewayDown", "gateway said 503", "Traceback ...")
    headers = copies.retry_headers(
        {"exception-stacktrace": "old", "return-count": 4, "exception-type": "old.Error"},
        retry_count=1, original=("orders", "k"), failure=failure,
    )
    assert headers["exception-type"] == "app.GatewayDown"
    assert headers["exception-message"] == "gateway said 503"
    assert "exception-stacktrace" not in headers and "return-count" not in headers
    back = copies.retry_headers(headers, retry_count=1, original=("orders", "k"), returns=2)
    assert back["return-count"] == 2 and "exception-type" not in back


def test_parked_headers_the_readme_lists() -> None:
    try:
        raise ValueError("bad card")
    except ValueError as exc:
        failure = copies.Failure.from_exception(exc)
    headers = copies.parked_headers(
        {"tenant": "acme", **BROKER},
        reason="exhausted",
        retry_count=5,
        queue="orders.fraud-check",
        original=("orders", "order.created"),
        failure=failure,
        now=NOW,
        parked_id="p-1",
    )
    assert headers["parked-reason"] == "exhausted"
    assert headers["parked-at"] == "2024-05-01T12:00:00.123Z"
    assert headers["retry-count"] == 5
    assert headers["exception-type"] == "ValueError"
    assert headers["exception-message"] == "bad card"
    assert headers["exception-stacktrace"].startswith("Traceback (most recent call last):\n")
    assert headers["exception-stacktrace"].endswith("ValueError: bad card\n")
    assert "test_parked_headers_the_readme_lists" in headers["exception-stacktrace"]
    assert headers["original-exchange"] == "orders"
    assert headers["original-routing-key"] == "order.created"
    assert headers["original-queue"] == "orders.fraud-check"
    assert headers["tenant"] == "acme"
    assert headers["x-death"] == BROKER["x-death"]  # history stays with the parked copy


def test_parked_headers_replace_stale_parking_headers_and_original_source() -> None:
    stale = {
        "original-exchange": "",
        "original-routing-key": "q",
        "exception-type": "Old",
        "exception-message": "old",
        "exception-stacktrace": "old",
    }
    headers = copies.parked_headers(
        stale,
        reason="exhausted",
        retry_count=7,
        queue="q",
        original=("orders", "order.created"),
        failure=None,
        now=NOW,
        parked_id="p-1",
    )
    assert (headers["original-exchange"], headers["original-routing-key"]) == (
        "orders",
        "order.created",
    )
    assert not {"exception-type", "exception-message", "exception-stacktrace"} & set(headers)


def test_exception_type_names_its_module() -> None:
    assert copies.Failure.from_exception(Permanent("x")).type == (
        "rabbit_retry.worker.consumer.Permanent"
    )
    assert copies.Failure.from_exception(KeyError("k")).type == "KeyError"


def test_cause_is_recorded() -> None:
    try:
        try:
            dict[str, int]()["sku"]
        except KeyError as inner:
            raise Permanent("unknown product") from inner
    except Permanent as exc:
        failure = copies.Failure.from_exception(exc)
    assert failure.stacktrace.startswith("caused by KeyError: 'sku'\n")


def deep(n: int, message: str) -> None:
    # Two functions in turn: Python collapses runs of identical frames, not alternating ones.
    if n == 0:
        raise RuntimeError(message)
    deeper(n - 1, message)


def deeper(n: int, message: str) -> None:
    deep(n, message)


def test_a_multi_megabyte_exception_is_bounded() -> None:
    try:
        deep(300, "€" * 2_000_000)  # 6 MB of UTF-8 and a 600-frame traceback
    except RuntimeError as exc:
        failure = copies.Failure.from_exception(exc)
    message = failure.message.encode()
    trace = failure.stacktrace.encode()
    assert len(message) <= copies.MAX_MESSAGE_BYTES
    assert len(trace) <= copies.MAX_STACKTRACE_BYTES
    assert failure.message.startswith("€€€")
    assert failure.message.endswith("[truncated 6000000 bytes]")
    assert failure.stacktrace.startswith("…[truncated ")
    assert "in deep" in failure.stacktrace
    assert failure.stacktrace.endswith("[truncated 6000000 bytes]\n")  # the exception line
    headers = copies.parked_headers(
        {},
        reason="exhausted",
        retry_count=1,
        queue="q",
        original=("", "q"),
        failure=failure,
        now=NOW,
        parked_id="p-1",
    )
    assert encoded_size(headers) < 12 * 1024


def test_a_broken_str_does_not_stop_parking() -> None:
    class Nasty(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

    failure = copies.Failure.from_exception(Nasty())
    assert failure.message == "<str() failed: RuntimeError>"


def test_parked_headers_shrink_to_fit_a_small_frame() -> None:
    try:
        deep(50, "x" * 10_000)
    except RuntimeError as exc:
        failure = copies.Failure.from_exception(exc)
    user = {"blob": "y" * 3000}
    headers = copies.parked_headers(
        user,
        reason="exhausted",
        retry_count=1,
        queue="q",
        original=("", "q"),
        failure=failure,
        now=NOW,
        parked_id="p-1",
        frame_max=8192,
    )
    assert encoded_size(headers) <= 8192 - copies.FRAME_RESERVE
    assert headers["blob"] == user["blob"]
    assert headers["exception-type"] == "RuntimeError"


@pytest.mark.parametrize("limit", [0, 1, 5, 30, 31, 32, 33, 100])
def test_truncation_is_utf8_safe(limit: int) -> None:
    text = "a€b€c" * 20
    for cut in (copies.truncate_head(text, limit), copies.truncate_tail(text, limit)):
        encoded = cut.encode("utf-8")  # would raise on a split character
        assert len(encoded) <= limit


def test_short_text_is_not_truncated() -> None:
    assert copies.truncate_head("short", 100) == "short"
    assert copies.truncate_tail("short", 100) == "short"


@settings(max_examples=300, deadline=None)
@given(text=st.text(), limit=st.integers(min_value=0, max_value=200))
def test_truncation_never_exceeds_its_limit(text: str, limit: int) -> None:
    for cut in (copies.truncate_head(text, limit), copies.truncate_tail(text, limit)):
        assert len(cut.encode("utf-8", "replace")) <= max(limit, 0)


# --- wire ----------------------------------------------------------------------------------------


def roundtrip(properties: spec.Basic.Properties) -> spec.Basic.Properties:
    raw = pamqp_header.ContentHeader(0, 3, properties).marshal()
    decoded = pamqp_header.ContentHeader()
    decoded.unmarshal(raw)
    result: spec.Basic.Properties = decoded.properties
    return result


HEADERS: dict[str, Any] = {
    "int": 1,
    "big": 2**40,
    "neg": -(2**33),
    "double": 0.1,
    "text": "grüße",
    "binary": b"\xff\xfe",
    "bytearray": bytearray(b"xy"),
    "when": datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
    "money": decimal.Decimal("-12.50"),
    "none": None,
    "yes": True,
    "table": {"list": [1, "a", {"deep": False}], "empty": {}},
    "empty-list": [],
}


def test_copy_properties_round_trip_every_decoded_value() -> None:
    source = spec.Basic.Properties(
        content_type="application/json",
        content_encoding="gzip",
        headers={"ignored": 1},
        delivery_mode=1,
        priority=3,
        correlation_id="c",
        reply_to="r",
        expiration="100",
        message_id="m",
        timestamp=datetime.datetime(2024, 1, 1, 0, 0, 1, tzinfo=datetime.UTC),
        message_type="t",
        user_id="guest",
        app_id="a",
    )
    copy = copy_properties(source, HEADERS, expiration=None, delivery_mode=2)
    got = roundtrip(copy)
    assert got.headers == HEADERS
    assert type(got.headers["double"]) is float
    assert got.expiration is None
    assert got.delivery_mode == 2
    for name in (
        "content_type",
        "content_encoding",
        "priority",
        "correlation_id",
        "reply_to",
        "message_id",
        "timestamp",
        "message_type",
        "user_id",
        "app_id",
    ):
        assert getattr(got, name) == getattr(source, name), name


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary().filter(lambda b: not _utf8(b)),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=20), children, max_size=4)
    ),
    max_leaves=15,
)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(headers=st.dictionaries(st.text(max_size=30), json_like, max_size=6))
def test_fuzzed_headers_round_trip(headers: dict[str, Any]) -> None:
    got = roundtrip(copy_properties(spec.Basic.Properties(message_id="m"), headers))
    assert got.headers == headers


def test_encode_table_rejects_what_amqp_cannot_carry() -> None:
    with pytest.raises(TypeError):
        encode_table({"x": object()})
    with pytest.raises(TypeError):
        encode_table({"x": 2**64})


def _field(name: str, kind: bytes, payload: bytes) -> bytes:
    return bytes((len(name),)) + name.encode() + kind + payload


# One value of every field type pamqp decodes, as other clients may send them.
EVERY_TYPE = b"".join((
    _field("t", b"t", b"\x01"), _field("b", b"b", b"\xff"), _field("B", b"B", b"\xff"),
    _field("s", b"s", b"\xff\xfe"), _field("u", b"u", b"\xff\xfe"),
    _field("I", b"I", b"\xff\xff\xff\xfe"), _field("i", b"i", b"\xff\xff\xff\xfe"),
    _field("l", b"l", b"\x00" * 7 + b"\x05"), _field("L", b"L", b"\x00" * 7 + b"\x06"),
    _field("f", b"f", b"\x3f\x80\x00\x00"),
    _field("d", b"d", b"\x3f\xb9\x99\x99\x99\x99\x99\x9a"),
    _field("D", b"D", b"\x02\x00\x00\x01\x00"),
    _field("T", b"T", b"\x00\x00\x00\x00\x65\x92\x00\x00"),
    _field("V", b"V", b""), _field("S", b"S", b"\x00\x00\x00\x02\xff\xfe"),
    _field("x", b"x", b"\x00\x00\x00\x01\x07"),
    _field("A", b"A", b"\x00\x00\x00\x05S\x00\x00\x00\x00"),
    _field("F", b"F", b"\x00\x00\x00\x03\x01kV"),
))


def _raw(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def test_decode_table_decodes_as_pamqp_does() -> None:
    for raw in (_raw(EVERY_TYPE), encode_table(HEADERS)):
        assert decode_table(raw) == dict(pamqp_decode.field_table(raw)[1])


def test_decode_table_leaves_out_what_keep_refuses() -> None:
    raw = _raw(EVERY_TYPE)
    whole = decode_table(raw)
    kept = decode_table(raw, lambda name: name in {"b", "S", "F"})
    assert kept == {name: whole[name] for name in ("b", "S", "F")}
    assert decode_table(raw, lambda name: False) == {}


@settings(max_examples=300, deadline=None)
@given(headers=st.dictionaries(st.text(max_size=30), json_like, max_size=6))
def test_fuzzed_headers_decode_as_pamqp_does(headers: dict[str, Any]) -> None:
    raw = encode_table(headers)
    assert decode_table(raw) == dict(pamqp_decode.field_table(raw)[1]) == headers
    first = sorted(headers)[:1]
    assert decode_table(raw, lambda name: name in first) == {k: headers[k] for k in first}


@pytest.mark.parametrize("raw", [
    _raw(EVERY_TYPE)[:-1],  # the last value cut short
    _raw(_field("q", b"Q", b"")),  # no such type
    b"\x00\x00\x00\x09" + _field("S", b"S", b"\x00\x00\x00\xff"),  # a length past the end
])
def test_decode_table_refuses_a_broken_table(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_table(raw)


def test_decode_table_refuses_a_name_past_the_end() -> None:
    with pytest.raises(ValueError, match="name runs past"):
        decode_table(b"\x00\x00\x00\x03\x09ab")
