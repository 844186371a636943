"""The message contract, in one place: every header rabbit-retry reads or writes, how a count
in a header is read, and how a message's properties are carried onto a copy (pure).

The worker, the parking verbs and the docs use these names; the README's "Parked copies" and
docs/versions.md say what each means. Nothing else defines a header name or reads a count.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

from aiormq import spec

from rabbit_retry.wire import CopyProperties

# Written by rabbit-retry.
RETRY_COUNT = "retry-count"  # failed handler calls so far
REPLAY_COUNT = "replay-count"  # times an operator replayed it from parking
HANDLE_AGAIN = "handle-again"  # true: a replay that runs even if its idempotency key is done
PARKED_REASON = "parked-reason"  # exhausted | permanent | invalid
PARKED_AT = "parked-at"  # ISO-8601 UTC
# This parked copy's own identity, new at every park: two parks of one message (or two
# messages alike to the byte, parked in the same millisecond) are two copies, never one.
PARKED_ID = "parked-id"
EXCEPTION_TYPE = "exception-type"
EXCEPTION_MESSAGE = "exception-message"
EXCEPTION_STACKTRACE = "exception-stacktrace"
ORIGINAL_EXCHANGE = "original-exchange"  # where it was first published, not the retry hop
ORIGINAL_ROUTING_KEY = "original-routing-key"
ORIGINAL_QUEUE = "original-queue"
# Returns without a verdict of a delivery from a classic queue, which counts none itself: carried
# on the copy that sends it back (a quorum queue's broker counts them in x-delivery-count).
RETURN_COUNT = "return-count"
# On a parked copy: failed attempts the broker recorded for another consumer of the queue (its
# rejections in x-death), not this worker's handler calls.
FAILURES_ELSEWHERE = "failures-elsewhere"
ORIGINAL_EXPIRATION = "original-expiration"  # a per-message TTL, moved off the copy
ORIGINAL_USER_ID = "original-user-id"  # a user_id the broker would refuse from us
# On a copy the failure desk replays: its audit entry's replay id, and a mark when an operator
# edited the copy. A copy that parks again brings them back to the desk (its history).
REPLAY_ID = "replay-id"
REPLAY_EDITED = "replay-edited"
# true: the message had no message_id and the copy's was made by rabbit-retry (a Celery task, for
# one, carries its id in correlation_id instead). Kept on replay: the id stays made up.
MESSAGE_ID_GENERATED = "message-id-generated"
# The span that published this copy (a worker's attempt that retried or parked it, an operator's
# replay), in W3C ``traceparent`` form; the next attempt's span links to it (README, "Traces").
# Kept on replay: a replay that is not traced leaves the link to the attempt that parked it.
COPY_SPAN = "copy-span"

# Ordered keys (``worker.ordering``). On a copy of an ordered queue's message: its key, and on
# the copy that holds the key (a retry, a parked copy, a copy sent back) the hold's id. A replay
# keeps both: a replayed holder is its key's next message.
ORDERED_KEY = "ordered-key"
ORDERED_HOLD = "ordered-hold"
# On a copy that holds its key: the lane whose held queue has the hold, as "LANE/LANES" (lane 2
# of 4: "2/4"). The copy goes back to that lane, not through the lanes exchange, whose
# consistent-hash ring RabbitMQ 3.10 and 4.0 rebuild in another order when a node restarts
# (docs/versions.md, "Ordered keys and a node restart"). A copy written before its queue got more
# lanes still goes back to its lane, and so does one written on a lane past the file of the
# worker that takes it (a lane ``migrate`` added, or one it is taking away: that lane is deleted
# only once no key is held for it); one naming a lane the broker does not have (the queue made
# again with fewer, a lane taken away) goes through the exchange.
ORDERED_LANE = "ordered-lane"
# A change of an ordered queue's lanes (``migrate``): on its entries (gate, fence, passed) the
# lanes they concern, as "0,1,2": the lanes a new lane waits for, those a fence is for, the lane
# that passed.
ORDERED_LANES = "ordered-lanes"
# In a lane's held queue: what an entry is (message | hold | release | gate | passed | fence |
# fenced: worker/ordering.py), its place in the lane's
# order, and for a hold since when (epoch seconds), why (retry | parked) and whose.
ORDERED_ENTRY = "ordered-entry"
ORDERED_SEQ = "ordered-seq"
ORDERED_SINCE = "ordered-since"
ORDERED_WHY = "ordered-why"
ORDERED_HOLDER = "ordered-holder"  # the holding message's message_id
# On a message sent through ``Q`` by an operator's tool: release the key's hold of that id (the
# holder was discarded or purged).
ORDERED_RELEASE = "ordered-release"

# Written by the broker.
X_DEATH = "x-death"
X_FIRST_DEATH_QUEUE = "x-first-death-queue"
X_FIRST_DEATH_EXCHANGE = "x-first-death-exchange"
X_DELIVERY_COUNT = "x-delivery-count"  # returns, as each version counts them (redelivery.py)
X_ACQUIRED_COUNT = "x-acquired-count"  # 4.3+: every return
# The broker's per-delivery counters: the same parked copy carries other values each time a
# quorum queue hands it out again.
RETURN_COUNTERS = frozenset({X_DELIVERY_COUNT, X_ACQUIRED_COUNT})

# The broker's bookkeeping about earlier hops: dropped from every retry copy, so counts never
# double and 3.x / 4.x behave the same.
BROKER_HEADERS = frozenset(
    {
        X_DEATH,
        "x-first-death-reason",
        X_FIRST_DEATH_QUEUE,
        X_FIRST_DEATH_EXCHANGE,
        "x-last-death-reason",
        "x-last-death-queue",
        "x-last-death-exchange",
        X_DELIVERY_COUNT,
        X_ACQUIRED_COUNT,
    }
)

# What a replay from parking removes: the broker's bookkeeping and everything parking added, so
# the replayed copy starts over with a clean count. original-exchange and original-routing-key
# stay: they say where the message was first published.
STRIPPED_PREFIXES = ("x-first-death-", "x-last-death-")
STRIPPED_ON_REPLAY = BROKER_HEADERS | {
    PARKED_REASON,
    PARKED_AT,
    PARKED_ID,
    RETRY_COUNT,
    RETURN_COUNT,
    FAILURES_ELSEWHERE,
    EXCEPTION_TYPE,
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    ORIGINAL_QUEUE,
    HANDLE_AGAIN,
    REPLAY_ID,  # a replay names itself; an earlier one's id would misattribute the copy
    REPLAY_EDITED,
}



def kept_on_replay(name: str) -> bool:
    """Whether a header survives a replay from parking (see ``STRIPPED_ON_REPLAY``)."""
    return name not in STRIPPED_ON_REPLAY and not name.startswith(STRIPPED_PREFIXES)


# Larger counts are not counts but garbage; capping also keeps every count we write back a
# valid AMQP signed 32-bit integer.
MAX_COUNT = 2**31 - 1


def as_text(value: object) -> str | None:
    """A header string: ``str`` as is, UTF-8 ``bytes`` decoded, anything else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def as_count(value: object) -> int | None:
    """A count header as a non-negative int; None when absent or not a count.

    Accepts ints, integral floats and decimals (JavaScript clients send numbers as doubles) and
    decimal digit strings or bytes; rejects bools, negatives, fractions (``2.5`` is no count of
    anything), NaN and values above ``MAX_COUNT``. The worker counts None as 0; the parking
    views show it as absent.
    """
    if isinstance(value, bool):
        return None
    number: int | None = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            number = int(value)
    elif isinstance(value, Decimal):
        if value.is_finite() and value == value.to_integral_value():
            number = int(value)
    elif isinstance(value, str | bytes | bytearray):
        text = as_text(value)
        if text is not None:
            text = text.strip()
            if 0 < len(text) <= 10 and text.isascii() and text.isdigit():
                number = int(text)
    if number is None or number < 0 or number > MAX_COUNT:
        return None
    return number


def as_flag(value: object) -> bool:
    """A yes/no header: true for ``True``, a non-zero count and ``"true"``/``"yes"``/``"1"``."""
    if isinstance(value, bool):
        return value
    text = as_text(value)
    if text is not None:
        return text.strip().lower() in ("true", "yes", "1")
    return bool(as_count(value))


def header_text(value: Any) -> str | None:
    """A header value as an operator reads and filters it; None for an absent value."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


# Why the broker itself put a message into a parking queue (the main queue's dead letters routed
# there: ``on_full: park`` / ``on_expire: park``), by the reason of its newest ``x-death`` entry.
# It cannot add ``parked-reason``; readers of a parking queue show this in its place.
BROKER_PARKED_REASONS = {
    "maxlen": "queue-full",
    "expired": "expired",
    "delivery_limit": "delivery-limit",
    "rejected": "rejected",
}


def parked_reason(headers: Mapping[str, Any]) -> str | None:
    """A parked message's reason: its ``parked-reason``, else (parked by the broker) the one its
    newest ``x-death`` entry gives (``BROKER_PARKED_REASONS``), else None."""
    reason = header_text(headers.get(PARKED_REASON))
    if reason is not None:
        return reason
    death = broker_parking(headers)
    return None if death is None else BROKER_PARKED_REASONS[as_text(death.get("reason")) or ""]


def broker_parking(headers: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``x-death`` entry of the broker's dead-lettering that parked this message (its newest
    one, with a reason in ``BROKER_PARKED_REASONS``), or None: parked by rabbit-retry (a copy
    has a ``parked-reason`` and no ``x-death``) or not parked."""
    if header_text(headers.get(PARKED_REASON)) is not None:
        return None
    deaths = headers.get(X_DEATH)
    # Newest first on every version: 3.x moves the entry it updates to the front.
    newest = deaths[0] if isinstance(deaths, list | tuple) and deaths else None
    if isinstance(newest, Mapping) and as_text(newest.get("reason")) in BROKER_PARKED_REASONS:
        return newest
    return None


# The basic properties a copy carries over, in the spec's order: all but ``headers`` (a copy has
# its own) and ``cluster_id`` (must be empty on publish; RabbitMQ never sets it).
PROPERTY_NAMES: tuple[str, ...] = tuple(
    name for name in spec.Basic.Properties.__slots__ if name not in ("headers", "cluster_id")
)


def copy_properties(
    source: spec.Basic.Properties, headers: Mapping[str, Any], **changes: Any
) -> CopyProperties:
    """A copy of ``source`` with ``headers`` and the given property ``changes``; header values
    round-trip exactly (``wire``)."""
    values: dict[str, Any] = {name: getattr(source, name, None) for name in PROPERTY_NAMES}
    values["headers"] = dict(headers)
    values.update(changes)
    return CopyProperties(**values)


def republish_properties(
    source: spec.Basic.Properties, headers: dict[str, Any], user: str, **changes: Any
) -> CopyProperties:
    """The properties of a copy rabbit-retry publishes as ``user`` (a retry, a park, a replay).

    - ``delivery_mode`` is always 2: a hop must survive a broker restart.
    - a ``user_id`` that is not ``user`` moves to ``original-user-id``: RabbitMQ refuses a
      publish whose ``user_id`` differs from the connection's user, which would hold the message
      for ever.
    - a message without ``message_id`` gets one, marked ``message-id-generated``: the client
      matches a broker's ``basic.return`` (an unroutable copy) to its publish by message id.
    """
    fields: dict[str, Any] = {"delivery_mode": 2, **changes}
    if not source.message_id and "message_id" not in changes:
        fields["message_id"] = new_message_id()
        headers[MESSAGE_ID_GENERATED] = True
    if source.user_id and source.user_id != user:
        fields.setdefault("user_id", None)
        headers.setdefault(ORIGINAL_USER_ID, source.user_id)
    return copy_properties(source, headers, **fields)


def release_headers(parked: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The headers of the message that lets a key go on when its parked holder is discarded or
    purged (sent to ``Q`` like a replay, so it reaches the key's lane the same way: with the
    key's header, or ``ordered-key`` for the routing key); None when ``parked`` holds no key."""
    if not parked or as_text(parked.get(ORDERED_HOLD)) is None:
        return None
    out = {name: value for name, value in parked.items() if kept_on_replay(name)}
    out[ORDERED_RELEASE] = as_text(parked.get(ORDERED_HOLD))
    return out


def new_message_id() -> str:
    return uuid.uuid4().hex
