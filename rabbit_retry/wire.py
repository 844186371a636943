"""Encoding a copy's headers so that no value changes on the way (the AMQP field table).

aiormq decodes headers with pamqp, whose encoder cannot write everything its decoder returns:
it rejects ``bytes`` (a long string that was not UTF-8) and writes every float as a 32-bit
``f``, silently corrupting a double such as ``0.1``. ``CopyProperties`` encodes the headers
table itself so that every decoded value goes back with the same value: doubles stay doubles,
non-UTF-8 strings stay byte strings, tables, arrays, decimals, timestamps and voids round-trip.
What the decoder already lost cannot come back: an integer's wire width (we write the smallest
signed type that holds it, as pamqp does) and whether a float was sent as ``f`` or ``d``
(we write ``d``, which holds every ``f`` exactly).
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from aiormq import spec
from pamqp import decode

_LONG = struct.Struct(">I")


def _long_bytes(data: bytes) -> bytes:
    return _LONG.pack(len(data)) + data


def _encode_int(value: int) -> bytes:
    if -(2**7) <= value < 2**7:
        return b"b" + struct.pack(">b", value)
    if -(2**15) <= value < 2**15:
        return b"s" + struct.pack(">h", value)
    if -(2**31) <= value < 2**31:
        return b"I" + struct.pack(">i", value)
    if -(2**63) <= value < 2**63:
        return b"l" + struct.pack(">q", value)
    raise TypeError(f"integer {value} does not fit an AMQP field")


def _encode_decimal(value: Decimal) -> bytes:
    exponent = value.as_tuple().exponent
    if not isinstance(exponent, int):
        raise TypeError(f"decimal {value} is not finite")
    scale = max(0, -exponent)
    unscaled = int(value.scaleb(scale))
    if scale > 255 or not -(2**31) <= unscaled < 2**31:
        raise TypeError(f"decimal {value} does not fit an AMQP decimal")
    return b"D" + struct.pack(">Bi", scale, unscaled)


def encode_value(value: Any) -> bytes:
    """One field value: type octet + payload."""
    if value is None:
        return b"V"
    if isinstance(value, bool):
        return b"t" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _encode_int(value)
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
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return b"T" + struct.pack(">Q", int(value.timestamp()))
    if isinstance(value, Mapping):
        return b"F" + encode_table(value)
    if isinstance(value, list | tuple):
        return b"A" + _long_bytes(b"".join(encode_value(item) for item in value))
    raise TypeError(f"cannot encode a {type(value).__name__} as an AMQP field value")


def encode_table(table: Mapping[str, Any]) -> bytes:
    """A field table: long length + (short string key, value) pairs, in the given order."""
    parts = []
    for key, value in table.items():
        name = key.encode("utf-8")
        if len(name) > 255:
            raise TypeError(f"header name longer than 255 bytes: {key[:40]!r}...")
        parts.append(bytes((len(name),)) + name + encode_value(value))
    return _long_bytes(b"".join(parts))


def encoded_size(table: Mapping[str, Any]) -> int:
    return len(encode_table(table))


# Payload size of each field type octet pamqp's decoder knows, by octet: a fixed size, or
# _SIZED (a long length, then that many bytes), or _UNKNOWN.
_SIZED, _UNKNOWN = -1, -2
_FIXED_SIZES = [_UNKNOWN] * 256
for _octets, _size in ((b"tbB", 1), (b"su", 2), (b"Iif", 4), (b"lLdT", 8), (b"D", 5),
                       (b"V\x00", 0), (b"SAFx", _SIZED)):
    for _octet in _octets:
        _FIXED_SIZES[_octet] = _size


def decode_table(raw: bytes, keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """A field table (long length first) as pamqp decodes it; with ``keep``, the values of
    the names it refuses are stepped over without being decoded (a parked copy's stack trace
    and ``x-death`` cost nothing to leave out)."""
    (size,) = _LONG.unpack_from(raw, 0)
    end = 4 + size
    if end > len(raw):
        raise ValueError("field table length exceeds the data")
    fixed_sizes, long_at, embedded = _FIXED_SIZES, _LONG.unpack_from, decode.embedded_value
    out: dict[str, Any] = {}
    at = 4
    while at < end:
        if at + 1 + raw[at] >= end:
            raise ValueError("a header name runs past the table")
        name_end = at + 1 + raw[at]
        name = raw[at + 1:name_end].decode()
        kind = raw[name_end]
        fixed = fixed_sizes[kind]
        if fixed >= 0:
            at = name_end + 1 + fixed
        elif fixed == _SIZED:
            at = name_end + 5 + long_at(raw, name_end + 1)[0]
        else:
            raise ValueError(f"header {name!r}: unknown field type {bytes((kind,))!r}")
        if at > end:
            raise ValueError(f"header {name!r}: value runs past the table")
        if keep is None or keep(name):
            out[name] = embedded(raw[name_end:at])[1]
    return out


class CopyProperties(spec.Basic.Properties):
    """``Basic.Properties`` whose headers are encoded by :func:`encode_table`."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers":
            return encode_table(value)
        result: bytes = super().encode_property(name, value)
        return result
