"""The worker: runs ``RetryConsumer`` subclasses with broker-native retries, parking and metrics.

Pure core: ``attempts`` (failures so far), ``redelivery`` (how each broker version counts
returns), ``decide`` (the decision table), ``copies`` (headers of retry and parked copies),
``pause`` (when a failing downstream pauses a queue), ``batch`` (a batch's outcome per
delivery), ``checks`` (what a consumer may declare).
Edges: ``consumer`` (what users write),
``session`` (one connection's consuming), ``lane`` (prefetch, and returned deliveries one at a
time), ``deadlines`` (handler timeouts on one timer), ``publisher`` (confirmed copies),
``idempotency`` (what a consumer declares), ``dedupe`` and ``stores`` (each key handled once;
loaded only when declared), ``runner`` (startup check, reconnects, shutdown), ``metrics``.
"""

from rabbit_retry.worker.batch import Batch, BatchResult
from rabbit_retry.worker.consumer import (
    NOT_DECODED,
    Delivery,
    HandlerTimeout,
    InvalidPayload,
    Permanent,
    RetryConsumer,
)
from rabbit_retry.worker.idempotency import Idempotency
from rabbit_retry.worker.pause import Pause
from rabbit_retry.worker.runner import Runner, run, run_consumers

__all__ = [
    "NOT_DECODED",
    "Batch",
    "BatchResult",
    "Delivery",
    "HandlerTimeout",
    "Idempotency",
    "InvalidPayload",
    "Pause",
    "Permanent",
    "RetryConsumer",
    "Runner",
    "run",
    "run_consumers",
]
