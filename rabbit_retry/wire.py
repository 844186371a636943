"""Header values with their AMQP field types: decoded so that each remembers its wire type,
encoded back byte for byte (the AMQP 0-9-1 field table, as RabbitMQ's errata lists it).

Why this module exists. A header's value has a wire type as well as a value: an integer is one
of ``b B s u I i l L`` (widths, signedness), a float ``f`` (32 bits) or ``d`` (64), and a
consumer in Java or .NET reads ``headers["n"]`` back as the type the publisher chose. aiormq
decodes tables with pamqp, which keeps values but not types (an ``I`` 5 is a Python 5, as is a
``b`` 5), and pamqp's encoder writes every float as ``f`` (corrupting a double such as ``0.1``)
and refuses bytes. So every copy rabbit-retry publishes (a retry tier, a park, a replay from
the CLI or the desk, a migration) would change the types of a foreign publisher's headers.

How it works, in one place:

- ``decode_table`` decodes a table into values that remember their type: a value whose type is
  the one ``encode_value`` would choose for the plain Python value (``b``/``s``/``I``/``l`` by
  size, ``d``, ``S``, ...) is the plain value; any other is an instance of a subclass of
  ``int``, ``float`` or ``datetime`` named for its type (``Int32(5)`` for an ``I`` 5,
  ``Float32`` for an ``f``, ``UInt8``...). ``encode_value`` writes each back with its type.
- ``keep_header_types()`` makes pamqp decode every field table it reads (message headers above
  all) with ``decode_table``. aiormq offers no hook per connection (the frames are decoded by a
  module-level ``pamqp.frame.unmarshal``), so this is process-wide; ``broker.connect`` calls it
  before opening any connection, so the worker, the CLI, the desk and migrate all read headers
  this way.

Why that is safe for the user's handler, who sees these values in ``delivery.headers``: the
subclasses are the builtins with nothing added (no attribute, no method but what the builtin
has): they compare, hash, format, ``repr``, JSON-encode and compute as the plain value does
(``Int32(5) == 5``, ``Int32(5) + 1`` is a plain ``6``), and ``isinstance(v, int)`` holds. Only
``type(v) is int`` tells them apart. The values are the ones pamqp gave before (its readings
kept: a ``D``'s digits are signed, a ``T`` above 2**32 is read as milliseconds), except that a
``T`` no datetime can hold is a ``RawTimestamp`` integer and a table name that is not UTF-8 is
decoded with ``surrogateescape`` (pamqp raised on both, and aiormq lost the whole connection).

What does not survive, as no Python value holds it: a ``t`` other than 0 or 1 comes back as 1;
the undocumented void ``\\x00`` comes back as ``V``; a signalling NaN in an ``f`` comes back
quiet; of two entries of one table with the same name, the last is kept.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from aiormq import spec
from pamqp import decode as pamqp_decode

_LONG = struct.Struct(">I")
_DECIMAL = struct.Struct(">Bi")  # scale, then the signed unscaled value (as pamqp, pika, Java)
_UTC = datetime.UTC


# --- the typed values --------------------------------------------------------------------------


class UInt8(int):
    """An AMQP ``B`` (unsigned 8-bit integer) header value."""

    __slots__ = ()


class Int16(int):
    """An AMQP ``s`` (signed 16-bit integer) whose value would fit a smaller type."""

    __slots__ = ()


class UInt16(int):
    """An AMQP ``u`` (unsigned 16-bit integer) header value."""

    __slots__ = ()


class Int32(int):
    """An AMQP ``I`` (signed 32-bit integer) whose value would fit a smaller type."""

    __slots__ = ()


class UInt32(int):
    """An AMQP ``i`` (unsigned 32-bit integer) header value."""

    __slots__ = ()


class Int64(int):
    """An AMQP ``l`` (signed 64-bit integer) whose value would fit a smaller type."""

    __slots__ = ()


class UInt64(int):
    """An AMQP ``L`` (unsigned 64-bit integer) header value (not in RabbitMQ's errata)."""

    __slots__ = ()


class RawTimestamp(int):
    """An AMQP ``T`` that no ``datetime`` can hold, as its 64-bit value."""

    __slots__ = ()


class Float32(float):
    """An AMQP ``f`` (32-bit float) header value; a plain ``float`` is a ``d``."""

    __slots__ = ()


class Timestamp(datetime.datetime):
    """An AMQP ``T`` header value: the aware UTC datetime pamqp gives, plus the 64-bit value
    it was read from (a value above 2**32 is read as milliseconds, which a datetime cannot
    write back exactly)."""

    __slots__ = ("raw",)
    raw: int


# type -> (type octet, payload layout)
_TYPED_INTS: dict[type, tuple[bytes, struct.Struct]] = {
    UInt8: (b"B", struct.Struct(">B")),
    Int16: (b"s", struct.Struct(">h")),
    UInt16: (b"u", struct.Struct(">H")),
    Int32: (b"I", struct.Struct(">i")),
    UInt32: (b"i", struct.Struct(">I")),
    Int64: (b"l", struct.Struct(">q")),
    UInt64: (b"L", struct.Struct(">Q")),
    RawTimestamp: (b"T", struct.Struct(">Q")),
}


# --- encoding ----------------------------------------------------------------------------------


def _long_bytes(data: bytes) -> bytes:
    return _LONG.pack(len(data)) + data


def _int_type(value: int) -> bytes:
    """The type a plain int is written as: the smallest signed one that holds it."""
    if -(2**7) <= value < 2**7:
        return b"b"
    if -(2**15) <= value < 2**15:
        return b"s"
    if -(2**31) <= value < 2**31:
        return b"I"
    if -(2**63) <= value < 2**63:
        return b"l"
    raise TypeError(f"integer {value} does not fit an AMQP field")


_SIGNED = {b"b": struct.Struct(">b"), b"s": struct.Struct(">h"), b"I": struct.Struct(">i"),
           b"l": struct.Struct(">q")}


def _encode_decimal(value: Decimal) -> bytes:
    exponent = value.as_tuple().exponent
    if not isinstance(exponent, int):
        raise TypeError(f"decimal {value} is not finite")
    scale = max(0, -exponent)
    unscaled = int(value.scaleb(scale))
    if scale > 255 or not -(2**31) <= unscaled < 2**31:
        raise TypeError(f"decimal {value} does not fit an AMQP decimal")
    return b"D" + _DECIMAL.pack(scale, unscaled)


def encode_value(value: Any) -> bytes:
    """One field value: type octet + payload; a typed value (``Int32``...) with its own type."""
    typed = _TYPED_INTS.get(type(value))
    try:
        if typed is not None:
            return typed[0] + typed[1].pack(value)
        if type(value) is Float32:
            return b"f" + struct.pack(">f", value)
    except (struct.error, OverflowError) as exc:
        raise TypeError(f"{value!r} does not fit an AMQP {type(value).__name__}") from exc
    if value is None:
        return b"V"
    if isinstance(value, bool):
        return b"t" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        kind = _int_type(value)
        return kind + _SIGNED[kind].pack(value)
    if isinstance(value, float):
        return b"d" + struct.pack(">d", value)
    if isinstance(value, Decimal):
        return _encode_decimal(value)
    if isinstance(value, str):
        return b"S" + _long_bytes(value.encode("utf-8"))
    if isinstance(value, bytes):
        return b"S" + _long_bytes(value)
    if isinstance(value, bytearray):
        return b"x" + _long_bytes(bytes(value))
    if isinstance(value, datetime.datetime):
        raw = getattr(value, "raw", None)
        if raw is not None:
            return b"T" + struct.pack(">Q", raw)
        if value.tzinfo is None:
            value = value.replace(tzinfo=_UTC)
        return b"T" + struct.pack(">Q", int(value.timestamp()))
    if isinstance(value, Mapping):
        return b"F" + encode_table(value)
    if isinstance(value, list | tuple):
        return b"A" + _long_bytes(b"".join(encode_value(item) for item in value))
    raise TypeError(f"cannot encode a {type(value).__name__} as an AMQP field value")


def encode_table(table: Mapping[str, Any]) -> bytes:
    """A field table: long length + (short string name, value) pairs, in the given order."""
    parts = []
    for key, value in table.items():
        name = key.encode("utf-8", "surrogateescape")
        if len(name) > 255:
            raise TypeError(f"header name longer than 255 bytes: {key[:40]!r}...")
        parts.append(bytes((len(name),)) + name + encode_value(value))
    return _long_bytes(b"".join(parts))


def encoded_size(table: Mapping[str, Any]) -> int:
    return len(encode_table(table))


# --- decoding ----------------------------------------------------------------------------------

_U8, _I8 = struct.Struct(">B"), struct.Struct(">b")
_U16, _I16 = struct.Struct(">H"), struct.Struct(">h")
_U32, _I32 = struct.Struct(">I"), struct.Struct(">i")
_U64, _I64 = struct.Struct(">Q"), struct.Struct(">q")
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")


def _timestamp(value: int) -> Any:
    # pamqp's reading: above 2**32 (the year 2106) it is taken for milliseconds.
    seconds = value / 1000.0 if value > 0xFFFFFFFF else value
    try:
        moment = datetime.datetime.fromtimestamp(seconds, tz=_UTC)
    except (OverflowError, OSError, ValueError):
        return RawTimestamp(value)
    stamp = Timestamp(moment.year, moment.month, moment.day, moment.hour, moment.minute,
                      moment.second, moment.microsecond, _UTC)
    stamp.raw = value
    return stamp


def _value(raw: bytes, at: int, end: int) -> tuple[Any, int]:
    """The value whose type octet is at ``raw[at]``, and where the next one starts."""
    return _DECODERS[raw[at]](raw, at + 1, end)


# One decoder per type octet: (raw, where its payload starts, the end of its table) -> (value,
# where the next one starts).
_Decoder = Callable[[bytes, int, int], tuple[Any, int]]


def _long_string(raw: bytes, at: int, end: int) -> tuple[Any, int]:  # S
    size = _U32.unpack_from(raw, at)[0]
    stop = at + 4 + size
    if stop > end:
        raise ValueError("a long string runs past its table")
    data = raw[at + 4:stop]
    try:
        return data.decode("utf-8"), stop
    except UnicodeDecodeError:
        return data, stop


def _array(raw: bytes, at: int, end: int) -> tuple[Any, int]:  # A
    size = _U32.unpack_from(raw, at)[0]
    stop = at + 4 + size
    if stop > end:
        raise ValueError("an array runs past its table")
    at += 4
    items = []
    while at < stop:
        item, at = _value(raw, at, stop)
        items.append(item)
    if at != stop:
        raise ValueError("an array's last value runs past it")
    return items, stop


def _byte_array(raw: bytes, at: int, end: int) -> tuple[Any, int]:  # x
    size = _U32.unpack_from(raw, at)[0]
    at += 4
    if at + size > end:
        raise ValueError("a byte array runs past its table")
    return bytearray(raw[at:at + size]), at + size


def _nested(raw: bytes, at: int, end: int) -> tuple[Any, int]:  # F
    size = _U32.unpack_from(raw, at)[0]
    return _table(raw, at + 4, at + 4 + size, None), at + 4 + size


def _signed(unpack: struct.Struct, typed: type[int], bits: int) -> _Decoder:
    """A signed integer: plain when the smallest type that holds it is this one (what
    ``encode_value`` would write), else typed."""
    size, low = unpack.size, -(2 ** (bits - 1))

    def decode(raw: bytes, at: int, end: int) -> tuple[Any, int]:
        number = unpack.unpack_from(raw, at)[0]
        return (typed(number) if low <= number < -low else number), at + size
    return decode


def _fixed(unpack: struct.Struct, make: Callable[[Any], Any]) -> _Decoder:
    size = unpack.size

    def decode(raw: bytes, at: int, end: int) -> tuple[Any, int]:
        return make(unpack.unpack_from(raw, at)[0]), at + size
    return decode


def _decimal(raw: bytes, at: int, end: int) -> tuple[Any, int]:  # D
    scale, unscaled = _DECIMAL.unpack_from(raw, at)
    return Decimal(unscaled).scaleb(-scale), at + 5


def _unknown(raw: bytes, at: int, end: int) -> tuple[Any, int]:
    raise ValueError(f"unknown field type {raw[at - 1:at]!r}")


def _same(value: Any) -> Any:
    return value


_DECODERS: list[_Decoder] = [_unknown] * 256
for _kind, _decoder in (
    (b"S", _long_string),
    (b"b", _fixed(_I8, _same)),
    (b"t", lambda raw, at, end: (raw[at] != 0, at + 1)),
    (b"l", _signed(_I64, Int64, 32)),  # plain above 32 bits: encode_value writes those as l
    (b"I", _signed(_I32, Int32, 16)),
    (b"s", _signed(_I16, Int16, 8)),
    (b"F", _nested),
    (b"A", _array),
    (b"d", _fixed(_F64, _same)),
    (b"f", _fixed(_F32, Float32)),
    (b"V", lambda raw, at, end: (None, at)),
    (b"\x00", lambda raw, at, end: (None, at)),  # the void pamqp accepts
    (b"T", _fixed(_U64, _timestamp)),
    (b"D", _decimal),
    (b"x", _byte_array),
    (b"B", _fixed(_U8, UInt8)),
    (b"u", _fixed(_U16, UInt16)),
    (b"i", _fixed(_U32, UInt32)),
    (b"L", _fixed(_U64, UInt64)),
):
    _DECODERS[_kind[0]] = _decoder


# Payload size of each type octet, for stepping over a value unread: a fixed size, or _SIZED (a
# long length, then that many bytes), or _UNKNOWN.
_SIZED, _UNKNOWN = -1, -2
_FIXED_SIZES = [_UNKNOWN] * 256
for _octets, _size in ((b"tbB", 1), (b"su", 2), (b"Iif", 4), (b"lLdT", 8), (b"D", 5),
                       (b"V\x00", 0), (b"SAFx", _SIZED)):
    for _octet in _octets:
        _FIXED_SIZES[_octet] = _size


def _table(raw: bytes, at: int, end: int, keep: Callable[[str], bool] | None) -> dict[str, Any]:
    if end > len(raw):
        raise ValueError("field table length exceeds the data")
    out: dict[str, Any] = {}
    try:
        while at < end:
            name_end = at + 1 + raw[at]
            if name_end >= end:
                raise ValueError("a header name runs past the table")
            name = raw[at + 1:name_end].decode("utf-8", "surrogateescape")
            if keep is None or keep(name):
                out[name], at = _value(raw, name_end, end)
            else:
                fixed = _FIXED_SIZES[raw[name_end]]
                if fixed >= 0:
                    at = name_end + 1 + fixed
                elif fixed == _SIZED:
                    at = name_end + 5 + _LONG.unpack_from(raw, name_end + 1)[0]
                else:
                    raise ValueError(
                        f"header {name!r}: unknown field type {raw[name_end:name_end + 1]!r}"
                    )
            if at > end:
                raise ValueError(f"header {name!r}: value runs past the table")
    except (struct.error, IndexError) as exc:
        raise ValueError("a field table is cut short") from exc
    return out


def decode_table(raw: bytes, keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """A field table (long length first), each value typed as the module docstring says; with
    ``keep``, the values of the names it refuses are stepped over without being decoded (a
    parked copy's stack trace and ``x-death`` cost nothing to leave out)."""
    if len(raw) < 4:
        raise ValueError("a field table is cut short")
    (size,) = _LONG.unpack_from(raw, 0)
    return _table(raw, 4, 4 + size, keep)


def _field_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """``decode_table`` in the shape of pamqp's decoders: (bytes used, table)."""
    if len(value) < 4:
        raise ValueError("a field table is cut short")
    (size,) = _LONG.unpack_from(value, 0)
    return 4 + size, _table(value, 4, 4 + size, None)


def keep_header_types() -> None:
    """Make pamqp (so aiormq, so every connection of this process) decode field tables with
    ``decode_table``; idempotent. See the module docstring for why this is process-wide."""
    pamqp_decode.METHODS["table"] = _field_table


class CopyProperties(spec.Basic.Properties):
    """``Basic.Properties`` whose headers are encoded by :func:`encode_table`."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers":
            return encode_table(value)
        result: bytes = super().encode_property(name, value)
        return result
