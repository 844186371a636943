"""Header values keep their AMQP type: a table decoded by ``wire`` is encoded back to the same
bytes, the typed values behave as the builtins do, and every connection decodes this way."""

from __future__ import annotations

import copy
import datetime as dt
import json
import pickle
import struct
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import decode as pamqp_decode
from pamqp import header as pamqp_header
from pamqp.commands import Basic
from support.fieldtables import SCALARS, field_values, split, table, tables

from rabbit_retry import wire
from rabbit_retry.contract import copy_properties

# Beyond what RabbitMQ passes on (SCALARS), what a decoder may still meet: L, NaN and infinity.
ANY_SCALAR = st.one_of(
    SCALARS,
    st.integers(0, 2**64 - 1).map(lambda v: b"L" + struct.pack(">Q", v)),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]).flatmap(
        lambda v: st.sampled_from([b"d" + struct.pack(">d", v), b"f" + struct.pack(">f", v)])),
)


@settings(max_examples=1000, deadline=None)
@given(raw=tables(ANY_SCALAR))
def test_a_decoded_table_encodes_back_to_the_same_bytes(raw: bytes) -> None:
    assert wire.encode_table(wire.decode_table(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(raw=tables(ANY_SCALAR))
def test_values_are_those_pamqp_gave(raw: bytes) -> None:
    """Types added, values unchanged: a handler reads what it read before (where pamqp could
    read the table at all: it refuses non-UTF-8 names and timestamps past the year 9999)."""
    try:
        before = dict(pamqp_decode.field_table(raw)[1])
    except ValueError:
        return
    after = wire.decode_table(raw)
    assert _same(after, before)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, wire.UInt64) and a >= 2**63:  # pamqp reads ``L`` as signed: its mistake
        return isinstance(b, int) and b == a - 2**64
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(b) in type(a).__mro__


@pytest.mark.parametrize(("value", "kind", "cls"), [
    (b"b\x05", b"b", int), (b"B\x05", b"B", wire.UInt8),
    (b"s\x00\x05", b"s", wire.Int16), (b"s\x01\x00", b"s", int),
    (b"u\x00\x05", b"u", wire.UInt16),
    (b"I\x00\x00\x00\x05", b"I", wire.Int32), (b"I\x00\x01\x00\x00", b"I", int),
    (b"i\x00\x00\x00\x05", b"i", wire.UInt32),
    (b"l" + struct.pack(">q", 5), b"l", wire.Int64), (b"l" + struct.pack(">q", 2**40), b"l", int),
    (b"L" + struct.pack(">Q", 5), b"L", wire.UInt64),
    (b"f" + struct.pack(">f", 0.5), b"f", wire.Float32),
    (b"d" + struct.pack(">d", 0.1), b"d", float),
    (b"T" + struct.pack(">Q", 1_700_000_000), b"T", wire.Timestamp),
    (b"T" + struct.pack(">Q", 2**63), b"T", wire.RawTimestamp),
])
def test_a_value_is_plain_unless_its_type_is_not_the_one_a_plain_value_gets(
    value: bytes, kind: bytes, cls: type
) -> None:
    decoded = wire.decode_table(table([(b"k", value)]))["k"]
    assert type(decoded) is cls
    assert wire.encode_value(decoded) == value
    assert wire.encode_value(decoded)[:1] == kind


def test_typed_values_behave_as_the_builtins() -> None:
    """What a handler does with ``delivery.headers``: compare, hash, print, serialise, compute."""
    raw = table([(b"n", b"I\x00\x00\x00\x05"), (b"u", b"B\xc8"), (b"f", b"f\x3f\x00\x00\x00"),
                 (b"t", b"T" + struct.pack(">Q", 1_700_000_000))])
    headers = wire.decode_table(raw)
    n, u, f, t = headers["n"], headers["u"], headers["f"], headers["t"]
    assert n == 5 and hash(n) == hash(5) and {5: "x"}[n] == "x"
    assert isinstance(n, int) and not isinstance(n, bool)
    assert (repr(n), str(n), f"{n:03d}") == ("5", "5", "005")
    assert type(n + 1) is int and n + 1 == 6 and type(-n) is int
    assert u == 200 and repr(u) == "200"
    assert f == 0.5 and repr(f) == "0.5" and type(f * 2) is float
    assert t == dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.UTC)
    assert t.isoformat() == "2023-11-14T22:13:20+00:00"
    assert json.dumps({"n": n, "u": u, "f": f}) == '{"n": 5, "u": 200, "f": 0.5}'
    # A copy of the headers keeps the types (so does pickling them).
    for again in (copy.deepcopy(headers), pickle.loads(pickle.dumps(headers))):
        assert wire.encode_table(again) == raw


def test_a_timestamp_read_as_milliseconds_is_written_back_exactly() -> None:
    raw = table([(b"t", b"T" + struct.pack(">Q", 1_700_000_000_123))])
    stamp = wire.decode_table(raw)["t"]
    assert stamp == dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=dt.UTC)
    assert wire.encode_table(wire.decode_table(raw)) == raw
    # Changed by the handler, it is a plain datetime again, written in seconds.
    assert wire.encode_value(stamp.replace(microsecond=0)) == b"T" + struct.pack(
        ">Q", 1_700_000_000)


def test_what_pamqp_refused_to_decode_is_read() -> None:
    """A name that is not UTF-8 or a timestamp no datetime holds made pamqp raise, which cost
    the whole connection (every delivery on it) in aiormq; they are read and kept."""
    raw = table([(b"\xff\xfe", b"b\x01"), (b"t", b"T" + b"\xff" * 8)])
    with pytest.raises(ValueError):
        pamqp_decode.field_table(raw)
    headers = wire.decode_table(raw)
    assert headers["t"] == 2**64 - 1
    assert wire.encode_table(headers) == raw


def test_plain_values_are_written_as_before() -> None:
    """Values made by Python code (ours: retry-count, parked-at; a handler's) get the types they
    always got: the smallest signed integer, doubles, long strings."""
    assert wire.encode_table({"n": 5, "big": 2**40, "x": 0.1, "s": "é", "b": b"\xff"}) == table([
        (b"n", b"b\x05"), (b"big", b"l" + struct.pack(">q", 2**40)),
        (b"x", b"d" + struct.pack(">d", 0.1)), (b"s", b"S\x00\x00\x00\x02\xc3\xa9"),
        (b"b", b"S\x00\x00\x00\x01\xff"),
    ])


@pytest.mark.parametrize("value", [wire.UInt8(256), wire.Int16(2**15), wire.UInt32(-1),
                                   wire.Float32(1e300), Decimal("1e-256"), 2**64])
def test_a_value_that_does_not_fit_its_type_is_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="does not fit"):
        wire.encode_value(value)


@pytest.mark.parametrize("raw", [
    b"\x00\x00",  # no length
    table([(b"k", b"I\x00\x00")]),  # a value cut short
    table([(b"k", b"A\x00\x00\x00\x01b\x05")]),  # an array's last value runs past it
    table([(b"k", b"F\x00\x00\x00\x09")]),  # a nested table past the data
    table([(b"k", b"Q")]),  # no such type
])
def test_a_broken_table_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        wire.decode_table(raw)


@settings(max_examples=200, deadline=None)
@given(raw=tables())
def test_keep_steps_over_the_values_it_refuses(raw: bytes) -> None:
    whole = wire.decode_table(raw)
    first = sorted(whole)[:1]
    assert wire.decode_table(raw, lambda name: name in first) == {k: whole[k] for k in first}


@settings(max_examples=300, deadline=None)
@given(raw=tables(), value=field_values())
def test_every_connection_decodes_headers_with_their_types(raw: bytes, value: bytes) -> None:
    """Once ``keep_header_types`` ran (``broker.connect`` runs it), a content header frame as
    aiormq reads it carries typed headers, and a copy of its properties writes the same table."""
    wire.keep_header_types()
    raw = table([*split(raw), (b"\x00extra", value)])
    frame = pamqp_header.ContentHeader(0, 3, _raw_properties(raw)).marshal()
    received = pamqp_header.ContentHeader()
    received.unmarshal(frame)
    properties = received.properties
    assert properties.message_id == "m"
    again = copy_properties(properties, properties.headers or {})
    assert again.encode_property("headers", again.headers) == raw


def _raw_properties(raw: bytes) -> Basic.Properties:
    class Raw(Basic.Properties):
        def encode_property(self, name: str, value: Any) -> bytes:
            if name == "headers":
                return raw
            result: bytes = super().encode_property(name, value)
            return result

    return Raw(headers={"set": True}, message_id="m", delivery_mode=2)
