"""Every copy the product publishes writes a foreign publisher's headers back byte for byte: a
retry copy, a parked copy, a replay from the CLI and from the desk, a migrated copy (pure; the
same paths on a real broker: tests/integration/test_header_types.py)."""

from __future__ import annotations

import datetime as dt

from hypothesis import given, settings
from support.fieldtables import RawHeaders, headers_bytes, received, split, tables

from rabbit_retry import contract
from rabbit_retry.broker.migrate_plan import moved_headers
from rabbit_retry.desk.ledger import Claimed
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.replay import copy_of
from rabbit_retry.parking.headers import replay_headers
from rabbit_retry.worker import copies

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


@settings(max_examples=300, deadline=None)
@given(raw=tables())
def test_every_copy_writes_the_publishers_headers_back_byte_for_byte(raw: bytes) -> None:
    sent = split(raw)
    names = {name for name, _ in sent}
    delivered = received(RawHeaders(headers=raw, message_id="m-1", delivery_mode=2))
    headers = delivered.headers or {}

    def copy(source: object, new_headers: dict[str, object], **changes: object) -> object:
        return contract.republish_properties(source, new_headers, "guest", **changes)

    parked_copy = copy(delivered, copies.parked_headers(
        headers, reason="exhausted", retry_count=2, queue="q", original=("ex", "rk"),
        failure=copies.Failure("ValueError", "boom", "trace"), now=NOW, parked_id="p-1",
    ), expiration=None)
    parked_delivered = received(parked_copy)
    row = {**parked("q", b"body", parked_delivered, now=NOW).row(), "id": 1}
    paths = {
        "tier": copy(delivered, copies.retry_headers(headers, retry_count=1,
                                                     original=("ex", "rk")), expiration=None),
        "park": parked_copy,
        "cli replay": copy(parked_delivered, replay_headers(parked_delivered.headers)),
        "desk replay": copy_of(row, Claimed("r-1", None, None), "guest").properties,
        "migrate": copy(delivered, moved_headers(headers)),
    }
    for path, properties in paths.items():
        got = [pair for pair in split(headers_bytes(properties)) if pair[0] in names]
        assert got == sent, path
