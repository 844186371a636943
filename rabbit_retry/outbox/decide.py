"""What becomes of an event the broker did not take, and how the relay words why (pure).

An event the broker returns (no queue bound for its routing key), refuses (``basic.nack``: a
queue it routes to is full or unavailable) or closes the channel over (its exchange is gone, it
is larger than the broker's ``max_message_size``) is ``failed`` and tried again after a wait
that doubles with each failure (``backoff.Backoff``, jittered, capped), until it has been tried
``attempts`` times: then it is ``dead`` and waits for an operator. A broker that cannot be
reached fails no event: the relay waits for it and publishes later.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiormq.exceptions

from rabbit_retry.backoff import Backoff
from rabbit_retry.outbox.names import DEAD, FAILED


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how late a failed event is tried again."""

    attempts: int = 10  # publishes tried, the first included, before an event is dead
    first_delay: float = 5.0  # seconds before the second try
    max_delay: float = 600.0  # the longest wait between two tries

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: at least 1, got {self.attempts}")
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError("delays: 0 < first_delay <= max_delay")

    def after_failure(self, attempts: int) -> tuple[str, float | None]:
        """(status, seconds until the next try) of an event whose ``attempts``-th publish
        failed; ``(DEAD, None)`` once it has had every attempt."""
        if attempts >= self.attempts:
            return DEAD, None
        return FAILED, Backoff(self.first_delay, self.max_delay, failures=attempts - 1).failed()


def refusal(error: BaseException, exchange: str, routing_key: str) -> str | None:
    """Why the broker would not take an event, from its publish's confirm error; None when the
    error is no verdict on the event (the channel or the connection went away)."""
    if isinstance(error, aiormq.exceptions.PublishError):
        frame = error.frame
        code = getattr(frame, "reply_code", None)
        text = getattr(frame, "reply_text", None) or "returned"
        where = f"exchange {exchange!r}" if exchange else "the default exchange"
        if code == 312:
            return (f"unroutable: no queue bound to {where} takes routing key {routing_key!r} "
                    f"(the broker returned it: {code} {text})")
        return f"the broker returned it: {code} {text}"
    if isinstance(error, aiormq.exceptions.DeliveryError):
        return ("the broker refused it (basic.nack): a queue it routes to is full "
                "(x-overflow reject-publish) or has no leader")
    return None


def channel_refusal(error: BaseException) -> str:
    """The broker's reason for closing a channel over one publish, as the event's error."""
    text = " ".join(str(part) for part in getattr(error, "args", ()) if part is not None)
    return f"the broker closed the channel: {text or type(error).__name__}"


def missing_exchange(exchange: str, vhost: str) -> str:
    return (f"exchange {exchange!r} does not exist in vhost {vhost!r} (apply the topology "
            "file to create it)")
