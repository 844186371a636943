"""The version rules of ``redelivery``, checked against what real brokers sent.

``fixtures/deliveries-<version>.json`` were captured with ``tests/support/deliveries.py`` on
RabbitMQ 3.10.8, 4.0.5 and 4.3.6 (one message taken through nack cycles, closed channels and
requeues, another through reject cycles); ``tests/integration/test_redelivery_fixtures.py``
recaptures on the broker under test and compares, so these files stay true.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rabbit_retry.topology.resolved import QueueType, RetryPolicy
from rabbit_retry.worker import decide as decisions
from rabbit_retry.worker.history import read
from rabbit_retry.worker.redelivery import Counting, counting, delivery_limit, parse_version

Q = "q"


# The rules applied to a delivery as the worker reads it: back on its queue by the route the
# broker's dead-lettering takes (the default exchange, routing key Q).
def returns(headers: Any, redelivered: bool = True) -> int:
    return read(headers, redelivered, "", Q, Q).returns


def is_suspect(headers: Any, redelivered: bool, queue_type: QueueType) -> bool:
    return decisions.runs_alone(read(headers, redelivered, "", Q, Q), queue_type)


def native_ok(headers: Any, rules: Counting, redelivered: bool = True) -> bool:
    return decisions.native_ok(read(headers, redelivered, "", Q, Q), rules)


def at_delivery_limit(headers: Any, redelivered: bool, limit: int | None) -> bool:
    policy = RetryPolicy(delays_ms=(1000,), max_attempts=5)
    rules = decisions.Rules(policy, "quorum", limit, counting("4.3.6"))
    action = decisions.decide(read(headers, redelivered, "", Q, Q), decisions.Outcome.ARRIVED,
                              rules)
    return getattr(action, "cause", None) is decisions.Cause.DELIVERY_LIMIT

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = ("3.10", "4.0", "4.3")


def fixture(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"deliveries-{version}.json").read_text())
    return data


def steps(version: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(delivery before the step, delivery after it) for each step of the capture."""
    seen = fixture(version)["deliveries"]
    return list(itertools.pairwise(seen))


@pytest.mark.parametrize("version", VERSIONS)
def test_each_fixture_is_of_its_version(version: str) -> None:
    assert counting(fixture(version)["version"]).label == version


@pytest.mark.parametrize("version", VERSIONS)
def test_a_nack_cycle_the_worker_allows_leaves_the_message_as_a_fresh_copy(version: str) -> None:
    """The rule that keeps one attempt's returns from being charged to the next."""
    rules = counting(fixture(version)["version"])
    allowed = 0
    for before, after in steps(version):
        if after["after"] != "native" or not native_ok(before["headers"], rules,
                                                       before["redelivered"]):
            continue
        allowed += 1
        assert returns(after["headers"], after["redelivered"]) == 0, (version, before, after)
        assert not is_suspect(after["headers"], after["redelivered"], "quorum")
    # 3.x resets the count on every cycle, 4.3 keeps a zero, 4.0 adds one to it.
    assert allowed == {"3.10": 2, "4.0": 0, "4.3": 1}[version]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_cycles_the_worker_refuses_would_have_carried_a_count(version: str) -> None:
    """The positive control of the test above: where ``native_ok`` says no, the broker really
    would have handed the message back counted or redelivered."""
    rules = counting(fixture(version)["version"])
    refused = [
        after
        for before, after in steps(version)
        if after["after"] == "native"
        and not native_ok(before["headers"], rules, before["redelivered"])
    ]
    assert len(refused) == {"3.10": 0, "4.0": 2, "4.3": 1}[version]
    for after in refused:
        assert after["redelivered"] and returns(after["headers"]) > 0, after


@pytest.mark.parametrize("version", VERSIONS)
def test_a_closed_channel_counts_one_return_and_makes_a_suspect(version: str) -> None:
    closes = [(b, a) for b, a in steps(version) if a["after"] == "close"]
    assert closes
    for before, after in closes:
        if before["after"] in ("publish", "close"):  # counting from a clean start
            assert returns(after["headers"]) == returns(before["headers"]) + 1
        assert is_suspect(after["headers"], after["redelivered"], "quorum")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_requeue_counts_where_the_rules_say(version: str) -> None:
    rules = counting(fixture(version)["version"])
    [(before, after)] = [(b, a) for b, a in steps(version) if a["after"] == "nack-requeue"]
    # 3.10 restarts from the nack cycle before it; compare with the cycle's own start.
    start = 0 if rules.native_cycle != "keeps" else returns(before["headers"])
    assert returns(after["headers"]) == start + (1 if rules.requeue_counts else 0)
    [(_, rejected)] = [(b, a) for b, a in steps(version) if a["after"] == "reject-requeue"]
    assert returns(rejected["headers"]) == returns(after["headers"]) + 1  # counts everywhere


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("3.10.8", (3, 10)), (b"4.3.6", (4, 3)), ("4.0.5", (4, 0)), (" 3.13.7 ", (3, 13)),
     ("4", None), (None, None), ("x.1", None), (b"\xff", None), (4, None)],
)
def test_parse_version(version: object, parsed: tuple[int, int] | None) -> None:
    assert parse_version(version) == parsed


@pytest.mark.parametrize(
    ("version", "default_limit", "cycle", "requeue_counts"),
    [
        ("3.10.8", None, "reset", True),
        ("3.13.7", None, "reset", True),
        ("4.0.5", 20, "adds", True),
        ("4.2.1", 20, "adds", True),
        ("4.3.6", 20, "keeps", False),
        ("5.0.0", 20, "keeps", False),
        (None, 20, "keeps", False),  # unknown: the newest rules, which never miss a limit
    ],
)
def test_counting(
    version: object, default_limit: int | None, cycle: str, requeue_counts: bool
) -> None:
    rules = counting(version)
    assert (rules.default_limit, rules.native_cycle, rules.requeue_counts) == (
        default_limit, cycle, requeue_counts
    )


@pytest.mark.parametrize(
    ("queue_type", "arguments", "version", "limit"),
    [
        ("quorum", {}, "3.10.8", 20),  # 3.x: no broker limit, the worker's own
        ("quorum", {}, "3.13.7", 20),
        ("quorum", {}, "4.0.5", 20),  # 4.x: 20 by default
        ("quorum", {}, "4.3.6", 20),
        ("quorum", {"x-delivery-limit": 5}, "3.10.8", 5),
        ("quorum", {"x-delivery-limit": 5}, "4.1.0", 5),
        ("quorum", {"x-delivery-limit": -1}, "4.1.0", None),  # 4.x: unlimited
        ("quorum", {"x-delivery-limit": 0}, "3.10.8", None),
        ("quorum", {"x-delivery-limit": "5"}, "4.1.0", None),
        ("quorum", {"x-delivery-limit": True}, "4.1.0", None),
        ("classic", {}, "4.1.0", None),
        ("classic", {"x-delivery-limit": 5}, "4.1.0", None),
    ],
)
def test_delivery_limit(
    queue_type: str, arguments: dict[str, object], version: object, limit: int | None
) -> None:
    assert delivery_limit(queue_type, arguments, counting(version)) == limit


@pytest.mark.parametrize(
    ("headers", "redelivered", "limit", "expected"),
    [
        ({"x-delivery-count": 2}, True, 2, True),  # one more return would cross the limit
        ({"x-delivery-count": 3}, True, 2, True),
        ({"x-delivery-count": 1}, True, 2, False),
        ({"x-delivery-count": 20}, False, 2, False),  # not a redelivery: a forged header
        ({"x-delivery-count": 20}, True, None, False),  # no limit
        ({}, True, 2, False),
        (None, True, 2, False),
        ({"x-delivery-count": "junk"}, True, 2, False),
        ({"x-delivery-count": -5}, True, 2, False),
        ({"x-delivery-count": b"7"}, True, 2, True),
    ],
)
def test_at_delivery_limit(
    headers: Any, redelivered: bool, limit: int | None, expected: bool
) -> None:
    assert at_delivery_limit(headers, redelivered, limit) is expected


@pytest.mark.parametrize(
    ("headers", "redelivered", "queue_type", "expected"),
    [
        ({}, False, "quorum", False),
        ({"x-delivery-count": 1}, True, "quorum", True),
        ({"x-delivery-count": 0, "x-acquired-count": 3}, True, "quorum", False),  # 4.3 requeue
        ({"x-delivery-count": 4}, False, "quorum", False),  # forged
        (None, True, "classic", True),  # classic: only the flag
        (None, False, "classic", False),
    ],
)
def test_is_suspect(headers: Any, redelivered: bool, queue_type: str, expected: bool) -> None:
    assert is_suspect(headers, redelivered, queue_type) is expected


@pytest.mark.parametrize(
    ("headers", "version", "expected"),
    [
        ({}, "3.10.8", True),
        ({"x-delivery-count": 3}, "3.10.8", True),  # 3.x resets it in the cycle
        ({}, "4.0.5", False),  # 4.0-4.2: the cycle itself counts
        ({}, "4.3.6", True),
        ({"x-delivery-count": 1}, "4.3.6", False),  # 4.3 would carry the 1 along
        ({"retry-count": 1}, "3.10.8", False),  # on the copy path once, it stays there
        ({"x-death": "garbled"}, "3.10.8", False),  # 3.x could not update it
    ],
)
def test_native_ok(headers: dict[str, Any], version: str, expected: bool) -> None:
    assert native_ok(headers, counting(version)) is expected


header_value = st.none() | st.booleans() | st.integers() | st.text() | st.binary()


@given(
    st.dictionaries(st.sampled_from(["x-delivery-count", "retry-count", "x-death"]), header_value),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 100)),
    st.sampled_from(["3.10.8", "4.0.5", "4.3.6", None]),
)
def test_nothing_here_raises_on_garbled_headers(
    headers: dict[str, Any], redelivered: bool, limit: int | None, version: str | None
) -> None:
    rules = counting(version)
    assert isinstance(at_delivery_limit(headers, redelivered, limit), bool)
    assert isinstance(is_suspect(headers, redelivered, "quorum"), bool)
    assert isinstance(native_ok(headers, rules), bool)
    assert returns(headers) >= 0


@pytest.mark.parametrize("version", VERSIONS)
def test_a_reject_cycle_counts_as_the_fixture_says(version: str) -> None:
    """``basic.reject(requeue=False)`` through the tier and back, as a consumer other than the
    worker may do it (docs/versions.md): ``x-death`` records a ``rejected`` death on every
    version, as for the worker's ``nack``; 3.10 comes back clean as after a ``nack``; 4.0 and
    4.3 come back redelivered with one return counted, from 0 too, which the worker reads as a
    possible crash. 4.3 differs from its own ``nack`` cycle there, which keeps a 0 at 0."""
    rejected = fixture(version)["rejects"][1]  # the first reject, from a count of 0
    nacked = fixture(version)["deliveries"][1]  # the first nack, from a count of 0
    assert rejected["after"] == "reject" and nacked["after"] == "native"
    assert rejected["x-death"] == nacked["x-death"] == ["TIER:expired:1", "Q:rejected:1"]
    comes_back_returned = version != "3.10"
    assert rejected["redelivered"] is comes_back_returned
    assert returns(rejected["headers"]) == (1 if comes_back_returned else 0)
    assert is_suspect(rejected["headers"], rejected["redelivered"], "quorum") is (
        comes_back_returned)
    if version == "4.3":
        assert not nacked["redelivered"] and returns(nacked["headers"]) == 0
