"""One log line per decision the worker carries out: queue, message id, attempt, outcome, and for
a failure its exception's type and message. Bodies are never logged.

Retries are logged at INFO, parks at WARNING, successes and duplicates at DEBUG only (most of
the traffic). Every field is also in the record's ``extra``, which ``--log-format json`` writes
as keys (``rabbit_retry.logs``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rabbit_retry.worker.decide import (
    Ack,
    Action,
    NativeRetry,
    Park,
    Requeue,
    TierRetry,
)

if TYPE_CHECKING:
    from rabbit_retry.worker.copies import Failure

log = logging.getLogger("rabbit_retry.worker")


def decision(
    queue: str,
    message_id: str | None,
    attempt: int,
    action: Action,
    failure: Failure | None,
    *,
    duplicate: bool = False,
) -> None:
    """Log the action carried out for a delivery whose ``attempt`` this was."""
    fields: dict[str, object] = {"queue": queue, "message_id": message_id, "attempt": attempt}
    if failure is not None:
        fields["exception_type"] = failure.type
        fields["exception_message"] = failure.message
    error = f" error={failure.type}: {failure.message}" if failure is not None else ""
    if isinstance(action, Ack):
        if log.isEnabledFor(logging.DEBUG):
            outcome = "duplicate" if duplicate else "success"
            log.debug("decision queue=%s message_id=%s attempt=%d outcome=%s", queue,
                      message_id, attempt, outcome, extra={**fields, "outcome": outcome})
    elif isinstance(action, NativeRetry | TierRetry):
        via = action.tier if isinstance(action, TierRetry) else "native"
        log.info(
            "decision queue=%s message_id=%s attempt=%d outcome=retried retry_count=%d"
            " delay_ms=%d via=%s%s",
            queue, message_id, attempt, action.retry_count, action.delay_ms, via, error,
            extra={**fields, "outcome": "retried", "retry_count": action.retry_count,
                   "delay_ms": action.delay_ms, "tier": via},
        )
    elif isinstance(action, Park):
        log.warning(
            "decision queue=%s message_id=%s attempt=%d outcome=parked reason=%s"
            " retry_count=%d%s",
            queue, message_id, attempt, action.reason.value, action.retry_count, error,
            extra={**fields, "outcome": "parked", "reason": action.reason.value,
                   "retry_count": action.retry_count},
        )
    elif isinstance(action, Requeue) and log.isEnabledFor(logging.DEBUG):
        log.debug("decision queue=%s message_id=%s attempt=%d outcome=returned returns=%d",
                  queue, message_id, attempt, action.returns,
                  extra={**fields, "outcome": "returned", "returns": action.returns})
