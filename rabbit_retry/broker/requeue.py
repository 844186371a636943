"""Giving back, in order, messages taken unacked from a queue to look at them; pure.

A classic queue puts a requeued message back in its place. A quorum queue loses the order of a
batch given back at once (seen on 3.10.8, 4.0.5 and 4.3.6: 100 messages taken and requeued with
one ``nack(multiple)``, or 33 and more requeued one by one without a pause, came back
shuffled), so what was taken from one goes back in small batches, in the order taken, each once
the queue shows the previous one back. Used by the parking verbs and by ``migrate``'s look at a
destination.
"""

from __future__ import annotations

from collections.abc import Iterable

# At most this many requeues on their way to a quorum queue at once (the broker's quorum queue
# client batches, and reorders, beyond 32 commands not yet applied).
REQUEUE_BATCH = 16
REQUEUE_WAIT_S = 5.0  # how long a quorum queue may take to show a batch given back
REQUEUE_POLL_S = 0.005


def requeue_batches(tags: Iterable[int], size: int = REQUEUE_BATCH) -> list[list[int]]:
    """Held delivery tags in the order they were taken, in batches of ``size``."""
    ordered = sorted(tags)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]
