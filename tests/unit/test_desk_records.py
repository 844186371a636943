"""A parked delivery as a store row and back (pure): exact round trip, one digest per copy."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

from pamqp import commands as spec

from rabbit_retry import wire
from rabbit_retry.desk.groups import group_id
from rabbit_retry.desk.records import parked, stored_body, stored_headers, stored_properties

NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)
HEADERS = {
    "parked-reason": "exhausted", "parked-at": "2026-11-20T10:00:00.123Z", "retry-count": 3,
    "exception-type": "TimeoutError", "exception-message": "gateway timed out after 30s",
    "a-double": 0.1, "not-utf8": b"\xff\xfe", "a-decimal": Decimal("1.25"),
    "a-table": {"nested": [1, "two", True]},
    "x-death": [{"count": 3, "queue": "orders", "time": dt.datetime(2024, 1, 1, tzinfo=dt.UTC)}],
}


def _props(**headers: object) -> spec.Basic.Properties:
    return spec.Basic.Properties(
        headers={**HEADERS, **headers}, message_id="m-1", correlation_id="c-1",
        content_type="application/json", timestamp=dt.datetime(2026, 1, 2, 3, 4, 5),
        priority=3, delivery_mode=2, app_id="shop",
    )


def _through_the_wire(properties: spec.Basic.Properties) -> spec.Basic.Properties:
    """What a consumer receives: the headers as pamqp decodes our encoding of them."""
    raw = wire.encode_table(properties.headers or {})
    from pamqp import decode

    _, table = decode.field_table(raw)
    values = {n: getattr(properties, n) for n in properties.__slots__ if n != "headers"}
    return spec.Basic.Properties(headers=table, **values)


def test_the_row_keeps_the_message_exactly() -> None:
    delivered = _through_the_wire(_props())
    p = parked("orders", b'{"id": 1}', delivered, now=NOW)
    row = {**p.row(), "id": 1}
    assert stored_body(row) == b'{"id": 1}'
    assert stored_headers(row) == delivered.headers
    back = stored_properties(row)
    for name in ("message_id", "correlation_id", "content_type", "priority", "app_id",
                 "delivery_mode", "timestamp"):
        assert getattr(back, name) == getattr(delivered, name), name
    assert (p.message_id, p.correlation_id, p.reason, p.attempts) == ("m-1", "c-1",
                                                                       "exhausted", 3)
    assert p.parked_at == dt.datetime(2026, 11, 20, 10, 0, 0, 123000, tzinfo=dt.UTC)
    assert p.group == group_id("orders", "TimeoutError", "gateway timed out after 30s",
                               reason="exhausted")
    assert p.pattern == "gateway timed out after <n>s"


def test_a_binary_body_is_kept_as_bytes_and_a_text_body_once_as_text() -> None:
    for body, as_text in ((b"\xff\x00\x01", False), (b"caf\xc3\xa9", True), (b"a\x00b", False)):
        row = parked("orders", body, _props(), now=NOW).row()
        assert (row["body_text"] is not None) is as_text
        assert (row["body"] is None) is as_text
        assert stored_body(row) == body


def test_the_same_copy_delivered_again_has_the_same_digest() -> None:
    first = parked("orders", b"x", _props(), now=NOW)
    again = parked("orders", b"x", _props(**{"x-delivery-count": 2, "x-acquired-count": 2}),
                   now=NOW + dt.timedelta(seconds=5))
    assert first.digest == again.digest
    assert "x-delivery-count" not in again.headers


def test_another_park_of_the_same_message_is_another_copy() -> None:
    first = parked("orders", b"x", _props(), now=NOW)
    for other in (
        parked("orders", b"x", _props(**{"parked-at": "2026-11-21T10:00:00.000Z"}), now=NOW),
        parked("orders", b"y", _props(), now=NOW),
        parked("payments", b"x", _props(), now=NOW),
    ):
        assert other.digest != first.digest


def test_two_parks_alike_to_the_millisecond_are_two_copies() -> None:
    """One message id and body parked twice by the worker in the same millisecond (a publisher
    sending a message twice to a handler that raises ``Permanent``): each park is its own copy,
    told apart by the ``parked-id`` the worker gives it."""
    from rabbit_retry.contract import new_message_id
    from rabbit_retry.worker.copies import Failure, parked_headers

    failure = Failure("rabbit_retry.worker.consumer.Permanent", "declined", "trace")
    copies = [
        parked_headers({"n": 1}, reason="permanent", retry_count=1, queue="orders",
                       original=("orders", "order.created"), failure=failure, now=NOW,
                       parked_id=new_message_id())
        for _ in range(2)
    ]
    assert copies[0]["parked-at"] == copies[1]["parked-at"]
    rows = [parked("orders", b"x", spec.Basic.Properties(headers=h, message_id="m-1"), now=NOW)
            for h in copies]
    assert rows[0].digest != rows[1].digest
    # The same copy delivered again is still one.
    again = parked("orders", b"x", spec.Basic.Properties(
        headers={**copies[0], "x-delivery-count": 1}, message_id="m-1"), now=NOW)
    assert again.digest == rows[0].digest


def test_without_parked_at_the_ingest_time_counts() -> None:
    p = parked("orders", b"x", spec.Basic.Properties(headers={}), now=NOW)
    assert p.parked_at == NOW
    assert (p.reason, p.exception_type, p.attempts, p.message_id) == (None, None, None, None)


def test_two_messages_the_broker_parked_alike_to_the_byte_are_two_rows(tmp_path: Path) -> None:
    """The broker parks a message itself (a full queue or an expired message with ``on_full``
    or ``on_expire: park``): no ``parked-id``, and ``x-death`` counts whole seconds. Two such
    messages alike (same body, no message id, the same second) have one digest. Delivered for
    the first time, each is a message of its own and gets a row (before, the desk stored one
    and acked both); delivered again (a desk stopped between its commit and its ack), each is
    known and skipped."""
    from rabbit_retry.desk.store import Store

    death = {"count": 1, "reason": "maxlen", "queue": "orders", "exchange": "",
             "time": dt.datetime(2026, 11, 23, 11, 59, 58), "routing-keys": ["orders"]}
    props = spec.Basic.Properties(delivery_mode=2, headers={
        "x-death": [death], "x-first-death-reason": "maxlen",
        "x-first-death-queue": "orders", "x-first-death-exchange": ""})
    alike = [parked("orders", b'{"event": "refresh"}', props, now=NOW) for _ in range(3)]
    assert len({p.digest for p in alike}) == 1
    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    second = dt.timedelta(seconds=1)
    assert store.insert(alike[:2], NOW, [True, True]) == 2
    assert store.insert(alike[2:], NOW + second, [True]) == 1  # a third, in a later batch
    assert store.insert(alike, NOW + 2 * second, [False, False, False]) == 0  # all again
