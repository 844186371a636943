"""Which parking queues the verbs may read, and how a quorum one gives back what was read; pure.

Reading a parking queue takes each message with ``basic.get`` and gives back what was not acted
on. A classic queue counts nothing and puts a requeued message back in its place. A quorum queue
counts each give-back as a return on RabbitMQ 3.10-4.2 (4.3: only a reject or a lost channel)
and drops or dead-letters a message past its delivery limit (20 by default on 4.x), so only a
quorum parking queue with the limit ``apply`` gives it (far beyond any number of looks) is read.
Quorum queues also lose the order of a batch given back at once (seen on 3.10.8, 4.0.5 and
4.3.6: 100 messages taken and requeued with one ``nack(multiple)``, or 33 and more requeued one
by one without a pause, came back shuffled), so they are given back in small batches, in order,
each once the queue has taken the previous one back (broker/requeue.py). And they hand out
what was given back before what never left: once every message has been looked at, giving back
the first two puts them behind the other four (seen on all three); so a look that stops early
takes the rest of what was there as well and gives everything back in order. Order on a quorum
queue also yields to the ``priority`` property on 4.x (parked copies keep it): 4.0 hands out 5
and above first, 4.3 ranks a message without priority as 4 and hands out 0-3 after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rabbit_retry.topology.compile import PARKING_DELIVERY_LIMIT


def peek_refusal(name: str, queue_type: str, arguments: Mapping[str, Any]) -> str | None:
    """Why the verbs will not read parking queue ``name``, or None when reading it is safe."""
    if queue_type == "classic":
        return None
    if queue_type == "quorum":
        limit = arguments.get("x-delivery-limit")
        if type(limit) is int and limit >= PARKING_DELIVERY_LIMIT:
            return None
        has = "no x-delivery-limit" if limit is None else f"x-delivery-limit {limit}"
        return (
            f"{name!r} is a quorum queue with {has}: every look at a message counts toward the "
            "limit past which the broker drops it; declare it with rabbit-retry apply "
            "(parking: {queue_type: quorum}), which sets a limit no look can reach"
        )
    return (
        f"{name!r} is a {queue_type} queue; rabbit-retry reads classic and quorum parking queues "
        "only"
    )
