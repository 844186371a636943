"""The worker: a ``RetryConsumer`` run with broker-native retries, parking and metrics.

Pure core: ``attempts`` (failures so far from headers), ``decide`` (the decision table),
``copies`` (headers of retry and parked copies). Edges: ``consumer`` (what users write),
``session`` (one connection's consuming), ``publisher`` (confirmed copies), ``runner``
(startup check, reconnects, shutdown), ``metrics``, ``wire`` (header encoding).
"""

from rabbit_retry.worker.consumer import (
    Delivery,
    HandlerTimeout,
    InvalidPayload,
    Permanent,
    RetryConsumer,
)
from rabbit_retry.worker.runner import Runner, run, run_consumers

__all__ = [
    "Delivery",
    "HandlerTimeout",
    "InvalidPayload",
    "Permanent",
    "RetryConsumer",
    "Runner",
    "run",
    "run_consumers",
]
