"""The message contract's rules, pinned once: counts read from headers, header text, and the
properties of a copy. The worker and the parking views both use them (``rabbit_retry.contract``)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from pamqp import commands as spec

from rabbit_retry.contract import (
    MAX_COUNT,
    PROPERTY_NAMES,
    as_count,
    header_text,
    republish_properties,
)
from rabbit_retry.parking.message import ParkedMessage
from rabbit_retry.worker.history import read

NOW = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3),
        ("3", 3),
        (b"3", 3),
        (" 4 ", 4),
        (3.0, 3),
        (Decimal("2"), 2),
        (bytearray(b"5"), 5),
        (MAX_COUNT, MAX_COUNT),
        (0, 0),
        (-1, None),
        ("-1", None),
        (True, None),
        (False, None),
        (2.5, None),  # a fraction is no count of anything
        (Decimal("2.5"), None),
        (float("nan"), None),
        (float("inf"), None),
        (Decimal("NaN"), None),
        ("three", None),
        ("٣", None),  # an Arabic-Indic digit: not a count in a header
        (b"\xff", None),
        (10**30, None),
        (MAX_COUNT + 1, None),
        ("9" * 200, None),
        (None, None),
        ([1], None),
        ({"count": 1}, None),
    ],
)
def test_as_count(value: object, expected: int | None) -> None:
    assert as_count(value) == expected


@pytest.mark.parametrize("garbled", [2.5, "2.5", -2, "two", True])
def test_the_worker_and_the_parking_views_read_a_garbled_retry_count_alike(
    garbled: object,
) -> None:
    # They used to disagree: retry-count 2.5 counted 0 failures in the worker and showed as 2
    # attempts in `parking show`.
    headers = {"retry-count": garbled}
    assert read(headers, False, "", "q", "q").failures == 0
    assert ParkedMessage(position=1, body=b"", headers=headers).attempts is None


@pytest.mark.parametrize(
    ("value", "text"),
    [("a", "a"), (b"b", "b"), (3, "3"), (True, "true"), (False, "false"), (None, None),
     (Decimal("1.50"), "1.50"), (NOW, "2024-05-01T12:00:00+00:00")],
)
def test_header_text(value: object, text: str | None) -> None:
    assert header_text(value) == text


def test_a_copy_keeps_every_property_and_swaps_the_headers() -> None:
    original = spec.Basic.Properties(
        content_type="application/json", content_encoding="gzip", headers={"a": 1},
        delivery_mode=2, priority=5, correlation_id="c", reply_to="r", expiration="60000",
        message_id="m", timestamp=NOW, message_type="t", user_id="guest", app_id="app",
    )
    copy = republish_properties(original, {"b": 2.5}, user="guest")
    for name in PROPERTY_NAMES:
        assert getattr(copy, name) == getattr(original, name), name
    assert copy.headers == {"b": 2.5}
    assert original.headers == {"a": 1}
    assert set(PROPERTY_NAMES) == set(original.__slots__) - {"headers", "cluster_id"}


def test_a_copy_is_persistent_and_has_a_message_id_marked_as_made_up() -> None:
    copy = republish_properties(spec.Basic.Properties(delivery_mode=1), {}, user="guest")
    assert copy.delivery_mode == 2
    assert copy.message_id
    assert copy.headers == {"message-id-generated": True}
    # A message with its own id (a copy of a copy among them) is not marked.
    again = republish_properties(spec.Basic.Properties(message_id="m"), {}, user="guest")
    assert again.message_id == "m" and again.headers == {}


def test_a_user_id_of_another_user_moves_to_a_header() -> None:
    # The broker refuses a publish whose user_id is not the connection's user.
    original = spec.Basic.Properties(user_id="svc-orders", message_id="m")
    copy = republish_properties(original, {}, user="operator")
    assert copy.user_id is None
    assert copy.headers == {"original-user-id": "svc-orders"}
