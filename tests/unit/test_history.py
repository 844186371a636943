"""A delivery's history: failures so far and the original source, from the header shapes each
RabbitMQ version writes, and which headers are believed from whom (the trust boundary).

The fixtures follow the dead-lettering guide (``dlx``) and the 3.13 / 4.0 release notes: one
``x-death`` table per (queue, reason), ``count`` incremented in place, newest first; 3.13 adds
``x-last-death-*``; 4.x renders ``x-death`` from broker annotations and quorum queues add
``x-delivery-count``. Values appear as aiormq (pamqp) decodes them: strings as ``str``,
``count`` as ``int``, ``time`` as an aware ``datetime``.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabbit_retry.contract import MAX_COUNT
from rabbit_retry.worker.history import read

Q = "orders.fraud-check"
TIER = Q + ".retry.5s"
T0 = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC)


# Deliveries that came back to Q by the route every copy and every dead-lettering of ours takes
# (the default exchange, routing key Q), unless a test says otherwise.
def failures_so_far(headers: Any, queue: str = Q) -> int:
    return read(headers, False, "", queue, queue).failures


def original_source(headers: Any, queue: str, exchange: str, routing_key: str) -> tuple[str, str]:
    return read(headers, False, exchange, routing_key, queue).source or (exchange, routing_key)


def broker_can_dead_letter(headers: Any) -> bool:
    return read(headers, False, "", Q, Q).x_death_clean


def death(queue: str, reason: str, count: int, exchange: str, keys: list[str]) -> dict[str, Any]:
    return {
        "count": count,
        "reason": reason,
        "queue": queue,
        "time": T0,
        "exchange": exchange,
        "routing-keys": keys,
    }


# Native path (one delay, quorum), after the 3rd failure, as 3.10 / 3.12 write it: the entry for
# (Q, rejected) keeps the first death's exchange and routing keys; the most recently updated
# entry comes first.
RABBITMQ_3_12_NATIVE = {
    "x-death": [
        death(TIER, "expired", 3, Q + ".retry", [Q]),
        death(Q, "rejected", 3, "orders", ["order.created"]),
    ],
    "x-first-death-exchange": "orders",
    "x-first-death-queue": Q,
    "x-first-death-reason": "rejected",
}

# 3.13 adds the x-last-death-* headers; the shape of x-death is unchanged.
RABBITMQ_3_13_NATIVE = {
    **RABBITMQ_3_12_NATIVE,
    "x-last-death-exchange": Q + ".retry",
    "x-last-death-queue": TIER,
    "x-last-death-reason": "expired",
}

# 4.x on a quorum queue: x-death from annotations (newest first), x-delivery-count from the
# queue (here 4: it also counts a redelivery after a worker restart, which is not a failure).
RABBITMQ_4_QUORUM_NATIVE = {
    "x-death": [
        {**death(Q, "rejected", 3, "orders", ["order.created"]), "time": T0},
        death(TIER, "expired", 3, Q + ".retry", [Q]),
    ],
    "x-first-death-exchange": "orders",
    "x-first-death-queue": Q,
    "x-first-death-reason": "rejected",
    "x-last-death-exchange": "",
    "x-last-death-queue": Q,
    "x-last-death-reason": "rejected",
    "x-delivery-count": 4,
}

# A copy the worker published after its 2nd failure: retry-count 2, and only the tier's expiry
# in x-death (the copy was published without the old x-death).
TIER_COPY_AFTER_2 = {
    "retry-count": 2,
    "original-exchange": "orders",
    "original-routing-key": "order.created",
    "x-death": [death(Q + ".retry.30s", "expired", 1, Q + ".retry", ["30s"])],
    "x-first-death-exchange": Q + ".retry",
    "x-first-death-queue": Q + ".retry.30s",
    "x-first-death-reason": "expired",
}

# 4.x quorum delivery limit (default 20) hit by a crashing consumer, then back via the tier.
RABBITMQ_4_DELIVERY_LIMIT = {
    "x-death": [
        death(TIER, "expired", 1, Q + ".retry", [Q]),
        death(Q, "delivery_limit", 1, "orders", ["order.created"]),
    ],
    "x-first-death-queue": Q,
    "x-first-death-exchange": "orders",
    "x-first-death-reason": "delivery_limit",
}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, 0),
        ({}, 0),
        ({"tenant": "acme"}, 0),
        (RABBITMQ_3_12_NATIVE, 3),
        (RABBITMQ_3_13_NATIVE, 3),
        (RABBITMQ_4_QUORUM_NATIVE, 3),
        (TIER_COPY_AFTER_2, 2),
        (RABBITMQ_4_DELIVERY_LIMIT, 1),
    ],
    ids=["none", "empty", "user-only", "3.12", "3.13", "4.x", "tier-copy", "delivery-limit"],
)
def test_failures_so_far_for_each_broker_shape(headers: Any, expected: int) -> None:
    assert failures_so_far(headers, Q) == expected


def test_rejected_and_delivery_limit_entries_add_up() -> None:
    headers = {
        "x-death": [
            death(Q, "rejected", 2, "orders", ["order.created"]),
            death(Q, "delivery_limit", 1, "orders", ["order.created"]),
            death(Q, "expired", 9, "orders", ["order.created"]),
            death(Q, "maxlen", 9, "orders", ["order.created"]),
        ]
    }
    assert failures_so_far(headers, Q) == 3


def test_the_larger_of_retry_count_and_x_death_wins() -> None:
    deaths = [death(Q, "rejected", 2, "orders", ["k"])]
    assert failures_so_far({"retry-count": 4, "x-death": deaths}, Q) == 4
    assert failures_so_far({"retry-count": 1, "x-death": deaths}, Q) == 2


def test_only_entries_of_this_queue_count() -> None:
    headers = {"x-death": [death("other", "rejected", 7, "orders", ["k"])]}
    assert failures_so_far(headers, Q) == 0
    assert failures_so_far(headers, "other") == 7


@pytest.mark.parametrize(
    "headers",
    [
        {"x-death": "not a list"},
        {"x-death": None},
        {"x-death": [1, "two", None, [3]]},
        {"x-death": [{"queue": Q}]},  # no reason, no count
        {"x-death": [{"queue": Q, "reason": "rejected", "count": "lots"}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": True}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": -3}]},
        {"x-death": [{"queue": 42, "reason": "rejected", "count": 1}]},
        {"x-death": [{"queue": Q, "reason": b"\xff", "count": 1}]},
        {"retry-count": "garbage"},
        {"retry-count": [1, 2]},
    ],
)
def test_garbled_values_count_as_zero(headers: dict[str, Any]) -> None:
    assert failures_so_far(headers, Q) == 0


def test_bytes_queue_and_reason_are_read_as_utf8() -> None:
    headers = {"x-death": [{"queue": Q.encode(), "reason": b"rejected", "count": b"2"}]}
    assert failures_so_far(headers, Q) == 2


def test_huge_counts_never_exceed_the_cap() -> None:
    headers = {"x-death": [death(Q, "rejected", MAX_COUNT, "x", ["k"])] * 3}
    assert failures_so_far(headers, Q) == MAX_COUNT


def test_a_hostile_mapping_is_garbled_not_fatal() -> None:
    class Hostile(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            raise RuntimeError("no")

    assert failures_so_far(Hostile(a=1), Q) == 0
    assert original_source(Hostile(a=1), Q, "ex", "rk") == ("ex", "rk")


# Anything a client could put in a header, nested.
header_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.decimals(allow_nan=True)
    | st.text()
    | st.binary()
    | st.datetimes(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["queue", "reason", "count", "exchange", "routing-keys", "x"])
            | st.text(),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)
header_tables = st.dictionaries(
    st.sampled_from(
        [
            "retry-count",
            "x-death",
            "x-first-death-queue",
            "x-first-death-exchange",
            "original-exchange",
            "original-routing-key",
        ]
    )
    | st.text(),
    header_values,
    max_size=6,
)


@settings(max_examples=500, deadline=None)
@given(headers=header_tables | header_values, queue=st.sampled_from([Q, "", "x"]) | st.text())
def test_fuzzed_headers_never_raise(headers: Any, queue: str) -> None:
    failures = failures_so_far(headers, queue)
    assert isinstance(failures, int)
    assert 0 <= failures <= MAX_COUNT
    exchange, routing_key = original_source(headers, queue, "ex", "rk")
    assert isinstance(exchange, str)
    assert isinstance(routing_key, str)


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {
                "queue": st.sampled_from([Q, "other", Q.encode()]),
                "reason": st.sampled_from(["rejected", "delivery_limit", "expired", "maxlen"]),
                "count": st.integers(min_value=0, max_value=1000),
            }
        ),
        max_size=6,
    ),
    retry_count=st.integers(min_value=0, max_value=1000),
)
def test_well_formed_headers_follow_the_rule(
    entries: list[dict[str, Any]], retry_count: int
) -> None:
    died = sum(
        e["count"]
        for e in entries
        if e["queue"] in (Q, Q.encode()) and e["reason"] in ("rejected", "delivery_limit")
    )
    headers = {"retry-count": retry_count, "x-death": entries}
    assert failures_so_far(headers, Q) == max(retry_count, died)


# --- original source ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        RABBITMQ_3_12_NATIVE,
        RABBITMQ_3_13_NATIVE,
        RABBITMQ_4_QUORUM_NATIVE,
        RABBITMQ_4_DELIVERY_LIMIT,
        TIER_COPY_AFTER_2,
    ],
    ids=["3.12", "3.13", "4.x", "delivery-limit", "tier-copy"],
)
def test_original_source_is_where_the_message_was_first_published(headers: Any) -> None:
    # The delivery itself came back through the default exchange with the queue's name as key.
    assert original_source(headers, Q, "", Q) == ("orders", "order.created")


def test_original_source_of_a_first_delivery_is_the_delivery() -> None:
    assert original_source({}, Q, "orders", "order.created") == ("orders", "order.created")
    assert original_source(None, Q, "orders", "order.created") == ("orders", "order.created")


def test_original_headers_win_over_x_death() -> None:
    headers = {
        **RABBITMQ_3_12_NATIVE,
        "original-exchange": b"billing",
        "original-routing-key": "invoice.paid",
    }
    assert original_source(headers, Q, "", Q) == ("billing", "invoice.paid")


def test_x_first_death_exchange_stands_in_for_a_missing_entry_exchange() -> None:
    headers = {
        "x-death": [{"queue": Q, "reason": "rejected", "count": 1, "routing-keys": ["k.1"]}],
        "x-first-death-queue": Q,
        "x-first-death-exchange": "orders",
    }
    assert original_source(headers, Q, "", Q) == ("orders", "k.1")


def test_garbled_x_death_falls_back_to_the_delivery() -> None:
    headers = {"x-death": [{"queue": Q, "exchange": 5, "routing-keys": "not a list"}]}
    assert original_source(headers, Q, "", Q) == ("", Q)
    assert original_source({"original-exchange": "only-one"}, Q, "e", "k") == ("e", "k")


# --- may the broker dead-letter it? -------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {"tenant": "x"},
        RABBITMQ_3_12_NATIVE,
        RABBITMQ_3_13_NATIVE,
        RABBITMQ_4_QUORUM_NATIVE,
        TIER_COPY_AFTER_2,
        RABBITMQ_4_DELIVERY_LIMIT,
        {"x-death": []},
    ],
    ids=["none", "empty", "user", "3.12", "3.13", "4.x", "tier-copy", "delivery-limit", "[]"],
)
def test_what_the_broker_wrote_it_can_dead_letter_again(headers: Any) -> None:
    assert broker_can_dead_letter(headers)


@pytest.mark.parametrize(
    "headers",
    [
        {"x-death": "rejected"},
        {"x-death": {"queue": Q, "reason": "rejected", "count": 2}},
        {"x-death": ["junk", 7, None]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": "1"}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": True}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": -5}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": 1.0}]},
        {"x-death": [{"queue": {"nested": [1]}, "reason": "rejected", "count": 1}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": 1, "routing-keys": "k"}]},
        {"x-death": [{"queue": Q, "reason": "rejected", "count": 1, "routing-keys": [1]}]},
    ],
)
def test_a_client_garbled_x_death_is_not_handed_to_the_broker(headers: Any) -> None:
    assert not broker_can_dead_letter(headers)


@settings(max_examples=300, deadline=None)
@given(headers=header_tables | header_values)
def test_broker_can_dead_letter_never_raises(headers: Any) -> None:
    assert broker_can_dead_letter(headers) in (True, False)


# --- the trust boundary: what a publisher can set ---------------------------------------------

FORGED = {
    "original-exchange": "evil",
    "original-routing-key": "evil.rk",
    "retry-count": 3,
    "x-death": [death(Q, "rejected", 1, "evil", ["evil.rk"])],
    "x-first-death-queue": Q,
    "x-first-death-exchange": "evil",
}


def test_a_message_published_through_an_exchange_keeps_no_forged_history() -> None:
    """A publisher's copies of our headers (or another system's history it carried along) on
    a message it sent through an exchange: no attempt taken away, no source rewritten, and
    never the broker's nack cycle (3.x would count on from its x-death)."""
    history = read(FORGED, False, "orders", "order.created", Q)
    assert (history.failures, history.retry_count, history.broker_failures) == (0, 0, 0)
    assert history.source is None
    assert not history.x_death_clean


def test_the_same_headers_on_our_route_are_believed() -> None:
    history = read(FORGED, False, "", Q, Q)
    assert history.failures == 3
    assert history.source == ("evil", "evil.rk")
    assert history.x_death_clean


def test_counts_of_returns_are_believed_only_on_a_redelivery() -> None:
    counts = {"x-delivery-count": 5, "x-acquired-count": 6}
    first = read(counts, False, "orders", "order.created", Q)
    assert (first.returns, first.acquired, first.returned) == (0, 0, False)
    again = read(counts, True, "orders", "order.created", Q)
    assert (again.returns, again.acquired, again.returned) == (5, 6, True)


def test_a_ttl_the_broker_moved_into_x_death_is_kept() -> None:
    headers = {"x-death": [
        death(TIER, "expired", 1, Q + ".retry", [Q]),
        {**death(Q, "rejected", 1, "orders", ["order.created"]), "original-expiration": "60000"},
    ]}
    assert read(headers, False, "", Q, Q).moved_expiration == "60000"
    assert read(headers, False, "orders", "order.created", Q).moved_expiration is None


def test_a_classic_queues_returns_are_read_from_the_copy_that_carries_them() -> None:
    assert read({"return-count": 4}, False, "", Q, Q).returns == 4
    assert read({"return-count": 4}, False, "orders", "order.created", Q).returns == 0
