"""NOT_FOUND replies: a missing object against one whose node is down (as brokers word them)."""

from __future__ import annotations

import pytest

from rabbit_retry.broker.absence import is_missing


@pytest.mark.parametrize("text", [
    "NOT_FOUND - no queue 'rel.orders.parking' in vhost 'v'",
    "NOT_FOUND - no exchange 'orders.retry' in vhost '/'",
    "NOT_FOUND - no queue 'it''s' in vhost 'a b'",
])
def test_no_queue_or_exchange_is_missing(text: str) -> None:
    assert is_missing(text)


@pytest.mark.parametrize("text", [
    # 4.3.6 cluster, the classic queue's node killed
    "NOT_FOUND - failed to perform operation on queue 'exp.classic.on.c2' in vhost '/' due to "
    "timeout",
    # 3.x / 4.0
    "NOT_FOUND - home node 'c2@localhost' of durable queue 'q' in vhost '/' is down or "
    "inaccessible",
    "",
])
def test_anything_else_may_be_an_outage(text: str) -> None:
    assert not is_missing(text)
