"""What crosses the test broker's "wire": a message's properties as the bytes of an AMQP content
header, and the header table edits the broker itself makes (test-only).

A publish is marshalled by the client's own code (pamqp, or ``rabbit_retry.wire`` for the
worker's copies, which subclass pamqp's properties) and a delivery is unmarshalled by pamqp, as
aiormq does on a real connection: a header value comes out of the test broker as it would come
out of RabbitMQ, types included. Where the broker adds or changes headers (``x-death``,
``x-delivery-count``, ...) it edits the table entry by entry and leaves every other entry's
bytes as the publisher wrote them, as RabbitMQ does; the values it writes have RabbitMQ's types
(counts are ``long``, times ``timestamp``, strings ``longstr``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

from aiormq import spec
from pamqp import decode
from pamqp.header import ContentHeader

_LONG = struct.Struct(">I")

# A header table as a list of (name, encoded value: type octet + payload), in wire order.
Entries = list[tuple[str, bytes]]


def marshal(properties: spec.Basic.Properties, body_size: int) -> bytes:
    """The content header a client sends for ``properties``."""
    return ContentHeader(0, body_size, properties).marshal()


def content_header(header: bytes) -> ContentHeader:
    """The content header frame a client reads from ``header``."""
    frame = ContentHeader()
    frame.unmarshal(header)
    return frame


def unmarshal(header: bytes) -> spec.Basic.Properties:
    """The properties a client reads from ``header``."""
    return content_header(header).properties


def _sized(data: bytes, at: int) -> int:
    """The end of a long-sized field (table, array) starting at ``at``."""
    return at + 4 + int(_LONG.unpack_from(data, at)[0])


def entries(table: bytes) -> Entries:
    """A field table (long size first) as raw entries."""
    end = _sized(table, 0)
    out: Entries = []
    at = 4
    while at < end:
        name_end = at + 1 + table[at]
        name = table[at + 1 : name_end].decode("utf-8")
        consumed, _ = decode.embedded_value(table[name_end:end])
        out.append((name, table[name_end : name_end + consumed]))
        at = name_end + consumed
    return out


def items(array: bytes) -> list[bytes]:
    """A field array's payload (long size first) as raw values."""
    end = _sized(array, 0)
    out = []
    at = 4
    while at < end:
        consumed, _ = decode.embedded_value(array[at:end])
        out.append(array[at : at + consumed])
        at += consumed
    return out


def value(raw: bytes) -> Any:
    """A raw field value (type octet first) as pamqp decodes it."""
    return decode.embedded_value(raw)[1]


# --- values as RabbitMQ writes them ------------------------------------------------------------


def long(number: int) -> bytes:
    return b"l" + struct.pack(">q", number)


def longstr(text: str) -> bytes:
    data = text.encode("utf-8")
    return b"S" + _LONG.pack(len(data)) + data


def timestamp(seconds: int) -> bytes:
    return b"T" + struct.pack(">Q", seconds)


def table(fields: Iterable[tuple[str, bytes]]) -> bytes:
    """A field table value (type octet first)."""
    return b"F" + _table_payload(fields)


def array(values: Sequence[bytes]) -> bytes:
    data = b"".join(values)
    return b"A" + _LONG.pack(len(data)) + data


def _table_payload(fields: Iterable[tuple[str, bytes]]) -> bytes:
    data = b"".join(bytes((len(n.encode()),)) + n.encode() + v for n, v in fields)
    return _LONG.pack(len(data)) + data


# --- editing a content header ------------------------------------------------------------------


class _RawTable(spec.Basic.Properties):
    """Properties whose ``headers`` holds an already encoded table."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers":
            return bytes(value)
        result: bytes = super().encode_property(name, value)
        return result


def header_entries(header: bytes) -> Entries | None:
    """The raw entries of the headers table in a content header; None when it has none."""
    properties = spec.Basic.Properties
    flags = struct.unpack_from(">H", header, 12)[0]
    if not flags & properties.flags["headers"]:
        return None
    at = 14
    for name in ("content_type", "content_encoding"):  # the short strings before the table
        if flags & properties.flags[name]:
            at += 1 + header[at]
    return entries(header[at : _sized(header, at)])


def rewrite(header: bytes, headers: Entries | None, *, drop_expiration: bool = False) -> bytes:
    """``header`` with its headers table replaced by ``headers`` (None: no table), and without
    its ``expiration`` if ``drop_expiration``."""
    source = unmarshal(header)
    body_size = struct.unpack_from(">Q", header, 4)[0]
    values = {name: getattr(source, name) for name in spec.Basic.Properties.__slots__}
    values["headers"] = None if headers is None else _table_payload(headers)
    if drop_expiration:
        values["expiration"] = None
    return ContentHeader(0, body_size, _RawTable(**values)).marshal()
