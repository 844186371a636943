"""The headers of the copies the worker publishes, and what an exception adds to a parked
one (pure).

A retry copy goes to ``Q.retry``; a parked copy goes to ``Q.parking``. Both keep the body and
headers of the delivery (their properties: ``contract.republish_properties``), except:

- the broker's bookkeeping (``contract.BROKER_HEADERS``: ``x-death``, ``x-delivery-count``, ...)
  is dropped from retry copies: counting lives in ``retry-count`` (see ``history``). Parked
  copies keep it as history.
- ``expiration`` is dropped from every copy and kept in the ``original-expiration`` header: a
  per-message TTL shorter than the tier's would cut the delay short, and in the parking queue
  (no dead-letter exchange) it would silently delete a parked message. The broker does the same
  when it dead-letters, keeping it only in ``x-death``'s ``original-expiration``: a copy of
  such a message takes it from there. A replay moves it back (``parking.headers``).
"""

from __future__ import annotations

import datetime
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rabbit_retry.contract import (
    BROKER_HEADERS,
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE,
    FAILURES_ELSEWHERE,
    ORIGINAL_EXCHANGE,
    ORIGINAL_EXPIRATION,
    ORIGINAL_QUEUE,
    ORIGINAL_ROUTING_KEY,
    PARKED_AT,
    PARKED_ID,
    PARKED_REASON,
    RETRY_COUNT,
    RETURN_COUNT,
)
from rabbit_retry.wire import encoded_size

if TYPE_CHECKING:
    from rabbit_retry.worker.history import History

# Bounds on what an exception may add to a parked copy's headers. RabbitMQ's smallest allowed
# frame_max is 4 KiB and its default 128 KiB; the content header frame (all properties and
# headers) must fit in one frame, so parking headers are kept far below it.
MAX_MESSAGE_BYTES = 2 * 1024
MAX_STACKTRACE_BYTES = 8 * 1024
# Room kept free in a content header frame for the frame envelope and the other properties.
FRAME_RESERVE = 1024
TRUNCATED = "…[truncated {n} bytes]"


def truncate_head(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes of ``text``, keeping its start, with a marker if cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    marker = TRUNCATED.format(n=len(data)).encode("utf-8")
    if limit <= len(marker):
        return data[: max(limit, 0)].decode("utf-8", "ignore")
    keep = data[: limit - len(marker)].decode("utf-8", "ignore")
    return keep + marker.decode("utf-8")


def truncate_tail(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes of ``text``, keeping its end (the innermost frames)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    marker = (TRUNCATED.format(n=len(data)) + "\n").encode("utf-8")
    if limit <= len(marker):
        return data[len(data) - max(limit, 0) :].decode("utf-8", "ignore")
    keep = data[len(data) - (limit - len(marker)) :].decode("utf-8", "ignore")
    return marker.decode("utf-8") + keep


def encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (lone surrogates, e.g. from a file name decoded
    with ``surrogateescape``) written as ``\\udcff`` escapes: a header is UTF-8 on the wire,
    and one that cannot be encoded would stop the message from parking."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _bounded_str(value: object, limit: int) -> str:
    """``str(value)`` bounded to ``limit`` bytes; a failing ``__str__`` does not escape."""
    try:
        text = str(value)
    except Exception as exc:  # a broken __str__ must not stop the message from parking
        text = f"<str() failed: {type(exc).__name__}>"
    return truncate_head(encodable(text), limit)


@dataclass(frozen=True, slots=True)
class Failure:
    """What a parked copy records about the exception that parked it."""

    type: str
    message: str
    stacktrace: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        kind = type(exc)
        name = kind.__qualname__
        if kind.__module__ not in ("builtins", "__main__"):
            name = f"{kind.__module__}.{name}"
        name = encodable(name)
        message = _bounded_str(exc, MAX_MESSAGE_BYTES)
        # The frames, then the exception line built from the bounded message, so a huge
        # message is never formatted twice into the trace.
        frames = "".join(traceback.format_tb(exc.__traceback__))
        chain = ""
        cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if cause is not None:
            chain = (
                f"caused by {type(cause).__qualname__}: {_bounded_str(cause, MAX_MESSAGE_BYTES)}\n"
            )
        trace = f"{chain}Traceback (most recent call last):\n{frames}{name}: {message}\n"
        return cls(
            type=name,
            message=message,
            stacktrace=truncate_tail(encodable(trace), MAX_STACKTRACE_BYTES),
        )


DELIVERY_LIMIT_REACHED = "rabbit_retry.worker.DeliveryLimitReached"
EXHAUSTED_ON_ARRIVAL = "rabbit_retry.worker.ExhaustedOnArrival"


def delivery_limit_failure(queue: str, limit: int) -> Failure:
    """What a parked copy says of a message the worker took at its delivery limit."""
    return Failure(
        type=DELIVERY_LIMIT_REACHED,
        message=f"returned to {queue!r} {limit} times without a verdict (the worker crashed, "
        "lost its connection or stopped while handling it); counted as one failed attempt, "
        "the handler was not called",
        stacktrace="",
    )


def arrival_failure(queue: str, history: History, max_attempts: int) -> Failure:
    """What a parked copy says of a message that arrived with no attempt left."""
    return Failure(
        type=EXHAUSTED_ON_ARRIVAL,
        message=f"arrived with {history.failures} failed attempt(s) recorded (retry-count "
        f"{history.retry_count}; rejections and delivery limits on {queue!r} in the broker's "
        f"x-death: {history.broker_failures}) and max_attempts is {max_attempts}; parked "
        "without calling the handler",
        stacktrace="",
    )


def _common(
    headers: Mapping[str, Any] | None, original: tuple[str, str], expiration: str | None
) -> dict[str, Any]:
    copied = dict(headers or {})
    # Overwritten, never kept: on a message a publisher sent through an exchange, an
    # ``original-*`` header is the publisher's word (``history``), not where it came from.
    copied[ORIGINAL_EXCHANGE] = original[0]
    copied[ORIGINAL_ROUTING_KEY] = original[1]
    if expiration:
        copied[ORIGINAL_EXPIRATION] = expiration
    return copied


def retry_headers(
    headers: Mapping[str, Any] | None,
    *,
    retry_count: int,
    original: tuple[str, str],
    expiration: str | None = None,
    returns: int = 0,
    failure: Failure | None = None,
) -> dict[str, Any]:
    """Headers of a retry copy, or of a delivery sent back to the end of its queue: broker
    bookkeeping dropped, ``retry-count`` set, ``return-count`` set where ``returns`` (a classic
    queue's returns, which only the copy can carry); a retry copy says which exception failed
    the attempt before (type and message; the stack trace only a parked copy carries)."""
    copied = {
        k: v
        for k, v in _common(headers, original, expiration).items()
        if k not in BROKER_HEADERS and k not in _FAILURE_HEADERS
    }
    copied[RETRY_COUNT] = retry_count
    if returns:
        copied[RETURN_COUNT] = returns
    if failure is not None:
        copied[EXCEPTION_TYPE] = truncate_head(failure.type, 255)
        copied[EXCEPTION_MESSAGE] = failure.message
    return copied


# What a copy says of an earlier failure or return: replaced on every copy, never carried over.
_FAILURE_HEADERS = frozenset({RETURN_COUNT, EXCEPTION_TYPE, EXCEPTION_MESSAGE,
                              EXCEPTION_STACKTRACE})


def parked_headers(
    headers: Mapping[str, Any] | None,
    *,
    reason: str,
    retry_count: int,
    queue: str,
    original: tuple[str, str],
    failure: Failure | None,
    now: datetime.datetime,
    parked_id: str,
    expiration: str | None = None,
    frame_max: int = 131072,
    elsewhere: int = 0,
) -> dict[str, Any]:
    """Headers of a parked copy (README, "The worker"), bounded to fit one content frame.

    If the delivery's own headers leave too little room under ``frame_max``, the stack trace and
    then the message shrink further, down to nothing; the copy always stays publishable.
    """
    copied = _common(headers, original, expiration)
    copied[ORIGINAL_EXCHANGE] = original[0]
    copied[ORIGINAL_ROUTING_KEY] = original[1]
    copied[ORIGINAL_QUEUE] = queue
    copied[PARKED_REASON] = reason
    copied[PARKED_AT] = (
        now.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )
    copied[PARKED_ID] = parked_id
    copied[RETRY_COUNT] = retry_count
    if elsewhere:
        copied[FAILURES_ELSEWHERE] = elsewhere
    else:
        copied.pop(FAILURES_ELSEWHERE, None)
    if failure is None:
        for key in (EXCEPTION_TYPE, EXCEPTION_MESSAGE, EXCEPTION_STACKTRACE):
            copied.pop(key, None)
        return copied
    copied[EXCEPTION_TYPE] = truncate_head(failure.type, 255)
    copied[EXCEPTION_MESSAGE] = failure.message
    copied[EXCEPTION_STACKTRACE] = failure.stacktrace
    budget = frame_max - FRAME_RESERVE
    overflow = encoded_size(copied) - budget
    for key in (EXCEPTION_STACKTRACE, EXCEPTION_MESSAGE):
        if overflow <= 0:
            break
        value = copied[key]
        size = len(value.encode("utf-8"))
        copied[key] = (
            truncate_tail(value, size - overflow)
            if key == EXCEPTION_STACKTRACE
            else truncate_head(value, size - overflow)
        )
        overflow = encoded_size(copied) - budget
    return copied

