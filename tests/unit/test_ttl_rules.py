"""A per-message TTL survives every path: moved into ``original-expiration`` by every copy,
from the ``x-death`` where the broker moved it on the one-tier nack path too, and restored as
``expiration`` by a replay (CLI and desk alike); pure."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pamqp import commands as spec

from rabbit_retry.parking.headers import replay_properties
from rabbit_retry.worker import copies
from rabbit_retry.worker.history import read

NOW = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
# What RabbitMQ writes when it dead-letters a message that had ``expiration: 60000`` (the worker
# nacked it into the one tier; the tier's TTL brought it back).
NACKED_BACK = {
    "x-death": [
        {"count": 1, "reason": "expired", "queue": "q.retry.1s", "exchange": "q.retry",
         "routing-keys": ["q"]},
        {"count": 1, "reason": "rejected", "queue": "q", "exchange": "orders",
         "routing-keys": ["order.created"], "original-expiration": "60000"},
    ],
}


def _moved(headers: dict[str, Any]) -> str | None:
    """What the worker reads of a TTL the broker moved, on a delivery back from its tier."""
    return read(headers, False, "", "q", "q").moved_expiration


def _parked(headers: dict[str, Any], expiration: str | None = None) -> dict[str, Any]:
    """A parked copy as the session builds it: the delivery's own expiration, else the moved
    one."""
    return copies.parked_headers(headers, reason="exhausted", retry_count=2, queue="q",
                                 original=("orders", "order.created"), failure=None, now=NOW,
                                 parked_id="p-1", expiration=expiration or _moved(headers))


def test_a_parked_copy_takes_the_ttl_the_broker_moved_into_x_death() -> None:
    assert _parked(NACKED_BACK)["original-expiration"] == "60000"
    # The retry copy too (a later attempt may park from a copy that has no x-death left).
    headers = copies.retry_headers(NACKED_BACK, retry_count=1, original=("orders", "o"),
                                   expiration=_moved(NACKED_BACK))
    assert headers["original-expiration"] == "60000"
    assert "x-death" not in headers


def test_the_delivery_s_own_expiration_and_an_earlier_copy_s_header_come_first() -> None:
    assert _parked(NACKED_BACK, expiration="5000")["original-expiration"] == "5000"
    earlier = {**NACKED_BACK, "original-expiration": "7000"}
    assert _parked(earlier)["original-expiration"] == "7000"


@pytest.mark.parametrize("deaths", [None, [], "garbled", [{"count": 1}], [7, {"x": 1}]])
def test_no_ttl_anywhere_adds_none(deaths: object) -> None:
    headers = {} if deaths is None else {"x-death": deaths}
    assert "original-expiration" not in _parked(headers)


def _replayed(headers: dict[str, Any], **props: Any) -> spec.Basic.Properties:
    parked = spec.Basic.Properties(headers=headers, message_id="m-1", **props)
    return replay_properties(parked, "guest")


def test_a_replay_puts_the_ttl_back() -> None:
    replayed = _replayed(_parked(NACKED_BACK))
    assert replayed.expiration == "60000"
    assert "original-expiration" not in (replayed.headers or {})
    assert "x-death" not in (replayed.headers or {})


# Not text of a count (the worker writes the broker's own text): a replay would be refused.
@pytest.mark.parametrize("value", ["soon", "-5", "1.5", b"\xff", 12])
def test_a_value_the_broker_would_refuse_as_an_expiration_stays_a_header(value: object) -> None:
    replayed = _replayed({"original-expiration": value})
    assert replayed.expiration is None
    assert (replayed.headers or {})["original-expiration"] == value


def test_a_parked_message_with_an_expiration_of_its_own_keeps_it() -> None:
    replayed = _replayed({"original-expiration": "60000"}, expiration="9000")
    assert replayed.expiration == "9000"
    assert (replayed.headers or {})["original-expiration"] == "60000"
