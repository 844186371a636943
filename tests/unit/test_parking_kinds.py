"""Which parking queues the verbs read, and the order a quorum one gets its messages back in."""

from __future__ import annotations

from rabbit_retry.broker.requeue import requeue_batches
from rabbit_retry.parking.kinds import peek_refusal
from rabbit_retry.topology.compile import PARKING_DELIVERY_LIMIT


def test_classic_and_applied_quorum_parking_queues_are_read() -> None:
    assert peek_refusal("q.parking", "classic", {}) is None
    assert peek_refusal("q.parking", "quorum", {"x-delivery-limit": PARKING_DELIVERY_LIMIT}) \
        is None


def test_a_quorum_parking_queue_a_look_could_empty_is_refused_with_what_to_do() -> None:
    assert peek_refusal("q.parking", "quorum", {}) == (
        "'q.parking' is a quorum queue with no x-delivery-limit: every look at a message counts "
        "toward the limit past which the broker drops it; declare it with rabbit-retry apply "
        "(parking: {queue_type: quorum}), which sets a limit no look can reach")
    # -1 is unlimited on 4.x but drops at the first return on 3.10; True is not a number
    for limit in (20, -1, True, "2147483647"):
        refusal = peek_refusal("q.parking", "quorum", {"x-delivery-limit": limit})
        assert refusal is not None and "x-delivery-limit" in refusal


def test_a_stream_is_refused() -> None:
    assert peek_refusal("q.parking", "stream", {}) == (
        "'q.parking' is a stream queue; rabbit-retry reads classic and quorum parking queues only")


def test_held_messages_go_back_in_the_order_taken_in_small_batches() -> None:
    assert requeue_batches({5, 1, 3, 2, 4}, size=2) == [[1, 2], [3, 4], [5]]
    assert requeue_batches(set()) == []
    assert all(len(b) <= 16 for b in requeue_batches(set(range(1, 100))))
