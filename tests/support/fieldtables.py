"""AMQP field tables as bytes, built and read apart from the code under test (test-only).

``rabbit_retry.wire`` decodes and encodes header tables; to test it, the tables here are made
byte by byte (hypothesis strategies over every field type), sent as they are (``RawHeaders``),
and read back as the bytes that came off the socket (``captured_headers`` watches the content
header frames aiormq receives). Nothing here uses ``wire``: a test compares what ``wire`` did
with bytes it never touched.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pamqp.frame
from hypothesis import strategies as st
from pamqp import commands as spec
from pamqp import header

from rabbit_retry import contract

_LONG = struct.Struct(">I")
# The header names rabbit-retry writes or strips: a publisher's own would be replaced by design,
# so tables made to survive a copy leave them out.
OURS = frozenset(
    name.encode() for name in (*contract.STRIPPED_ON_REPLAY, contract.REPLAY_COUNT,
                               contract.ORIGINAL_EXCHANGE, contract.ORIGINAL_ROUTING_KEY,
                               contract.ORIGINAL_EXPIRATION, contract.ORIGINAL_USER_ID,
                               contract.MESSAGE_ID_GENERATED, "replay-id")
)

# Payload size of each fixed-size type octet; S A F x are a long length then that many bytes.
FIXED = {b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"I": 4, b"i": 4, b"f": 4, b"l": 8,
         b"L": 8, b"d": 8, b"T": 8, b"D": 5, b"V": 0}
SIZED = frozenset({b"S", b"A", b"F", b"x"})


def long_bytes(data: bytes) -> bytes:
    return _LONG.pack(len(data)) + data


def table(fields: list[tuple[bytes, bytes]]) -> bytes:
    """A field table of (name, type octet + payload) pairs, in order."""
    return long_bytes(b"".join(bytes((len(name),)) + name + value for name, value in fields))


def split(raw: bytes) -> list[tuple[bytes, bytes]]:
    """A field table's (name, type octet + payload) pairs, in order, nothing decoded."""
    (size,) = _LONG.unpack_from(raw, 0)
    end, at, out = 4 + size, 4, []
    assert end <= len(raw), "table longer than its data"
    while at < end:
        name = raw[at + 1:at + 1 + raw[at]]
        at += 1 + raw[at]
        kind = raw[at:at + 1]
        length = 4 + _LONG.unpack_from(raw, at + 1)[0] if kind in SIZED else FIXED[kind]
        out.append((name, raw[at:at + 1 + length]))
        at += 1 + length
    assert at == end, "a value runs past its table"
    return out


# --- hypothesis: field values as bytes ---------------------------------------------------------


def _packed(kind: bytes, layout: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return values.map(lambda v: kind + struct.pack(layout, v))


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    # Small values too: an ``I`` 5 is what a decoder that keeps values but not types loses.
    return st.one_of(st.integers(-3, 3).filter(lambda v: low <= v <= high),
                     st.integers(low, high))


# What RabbitMQ 3.10 to 4.3 accept and pass on unchanged (docs/versions.md, "Header types"):
# not NaN or infinity (the broker closes the publisher's connection), not ``L`` (4.x and 3.10
# quorum queues rewrite it as ``l``), not a ``t`` other than 0 or 1 (rewritten as 1), not the
# ``\x00`` void (refused).
SCALARS: st.SearchStrategy[bytes] = st.one_of(
    st.sampled_from([b"t\x00", b"t\x01", b"V"]),
    _packed(b"b", ">b", _ints(8, True)), _packed(b"B", ">B", _ints(8, False)),
    _packed(b"s", ">h", _ints(16, True)), _packed(b"u", ">H", _ints(16, False)),
    _packed(b"I", ">i", _ints(32, True)), _packed(b"i", ">I", _ints(32, False)),
    _packed(b"l", ">q", _ints(64, True)),
    _packed(b"f", ">f", st.floats(width=32, allow_nan=False, allow_infinity=False)),
    _packed(b"d", ">d", st.floats(allow_nan=False, allow_infinity=False)),
    st.tuples(st.integers(0, 255), st.integers(-(2**31), 2**31 - 1)).map(
        lambda p: b"D" + struct.pack(">Bi", *p)),
    # seconds; above 2**32 what pamqp reads as milliseconds; beyond any datetime
    _packed(b"T", ">Q", st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**44),
                                  st.integers(0, 2**64 - 1))),
    st.text(max_size=20).map(lambda s: b"S" + long_bytes(s.encode("utf-8"))),
    st.binary(max_size=20).map(lambda b: b"S" + long_bytes(b)),  # often not UTF-8
    st.binary(max_size=20).map(lambda b: b"x" + long_bytes(b)),
)
# Names are short strings; RabbitMQ passes one that is not UTF-8 on as it is.
NAMES = st.one_of(st.text(min_size=1, max_size=12).map(lambda s: s.encode("utf-8")),
                  st.binary(min_size=1, max_size=12))


def field_values(scalars: st.SearchStrategy[bytes] = SCALARS) -> st.SearchStrategy[bytes]:
    """Any field value, tables and arrays nested up to a few levels."""
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda items: b"A" + long_bytes(b"".join(items))),
            st.lists(st.tuples(NAMES, inner), max_size=4, unique_by=lambda p: p[0]).map(
                lambda fields: b"F" + table(fields)),
        ),
        max_leaves=12,
    )


def tables(scalars: st.SearchStrategy[bytes] = SCALARS, *, max_size: int = 8,
           reserved: frozenset[bytes] = OURS) -> st.SearchStrategy[bytes]:
    """Whole field tables; names in ``reserved`` (by default the headers the product writes)
    and the broker's ``x-`` names left out."""
    names = NAMES.filter(lambda n: n not in reserved and not n.startswith(b"x-"))
    return st.lists(st.tuples(names, field_values(scalars)), max_size=max_size,
                    unique_by=lambda p: p[0]).map(table)


# --- on the wire -------------------------------------------------------------------------------


class RawHeaders(spec.Basic.Properties):
    """Properties whose ``headers`` are sent as the given table bytes, exactly."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers":
            assert isinstance(value, bytes)
            return value
        result: bytes = super().encode_property(name, value)
        return result


@dataclass(frozen=True)
class Seen:
    """A content header frame as it came off the socket: its message id and headers bytes."""

    message_id: str | None
    headers: bytes  # the field table, long length first; b"" when the message had none


def _read_header_frame(payload: bytes) -> Seen:
    # class (2), weight (2), body size (8), then property flags: one 16-bit word is enough for
    # Basic's 14 properties (bit 0 would announce another word).
    (flags,) = struct.unpack_from(">H", payload, 12)
    at = 14
    found: dict[str, Any] = {}
    for name in spec.Basic.Properties.__slots__:
        if not flags & spec.Basic.Properties.flags[name]:
            continue
        kind = getattr(spec.Basic.Properties, "_" + name)
        if kind == "shortstr":
            found[name] = payload[at + 1:at + 1 + payload[at]].decode("utf-8")
            at += 1 + payload[at]
        elif kind == "table":
            length = 4 + _LONG.unpack_from(payload, at)[0]
            found[name] = payload[at:at + length]
            at += length
        elif kind == "octet":
            at += 1
        elif kind == "timestamp":
            at += 8
        else:
            raise AssertionError(f"unexpected property type {kind}")
    return Seen(found.get("message_id"), found.get("headers", b""))


@contextlib.contextmanager
def captured_headers() -> Iterator[list[Seen]]:
    """Every content header frame any aiormq connection of this process receives meanwhile."""
    seen: list[Seen] = []
    real = pamqp.frame.unmarshal

    def spy(data_in: bytes) -> Any:
        if data_in[:1] == b"\x02":  # a content header frame: type, channel (2), size (4)
            seen.append(_read_header_frame(data_in[7:-1]))
        return real(data_in)

    pamqp.frame.unmarshal = spy
    try:
        yield seen
    finally:
        pamqp.frame.unmarshal = real


def received(properties: spec.Basic.Properties) -> spec.Basic.Properties:
    """``properties`` as a consumer of this process receives them: marshalled into a content
    header frame and read back the way aiormq reads one (with ``wire``'s decoder, which every
    connection the product opens installs)."""
    from rabbit_retry.wire import keep_header_types

    keep_header_types()
    frame = header.ContentHeader(0, 3, properties).marshal()
    back = header.ContentHeader()
    back.unmarshal(frame)
    result: spec.Basic.Properties = back.properties
    return result


def headers_bytes(properties: spec.Basic.Properties) -> bytes:
    """The headers table ``properties`` put on the wire (b"" when they have none)."""
    return _read_header_frame(header.ContentHeader(0, 3, properties).marshal()).headers
