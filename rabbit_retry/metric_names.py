"""Every Prometheus series rabbit-retry exposes, named once: the worker's, the failure desk's and
the outbox relay's.

The worker and the desk register their metrics from these specs, and ``export --format alerts``
and ``--format grafana`` query them, so a rename reaches all three. ``name`` is the series as
Prometheus stores it and PromQL queries it (a counter's ``_total`` included; prometheus-client
takes that name and adds nothing). A histogram's samples are ``name`` + ``_bucket`` / ``_sum``
/ ``_count``.

``queue`` is always a main queue's name as the topology file spells it: the desk labels a parked
message with the queue it was parked from (``original-queue``), never ``Q.parking``, so one
matcher selects a queue's worker and desk series alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...]
    help: str


# --- the worker (README, "The worker") -----------------------------------------------------------

MESSAGES = Series(
    "rabbit_retry_messages_total",
    "counter",
    ("queue", "outcome"),
    "Messages handled, by final outcome of this delivery.",
)
PARKED = Series(
    "rabbit_retry_parked_total", "counter", ("queue", "reason"), "Messages parked, by reason."
)
HANDLER_SECONDS = Series(
    "rabbit_retry_handler_seconds", "histogram", ("queue",), "Time spent in the handler."
)
IN_FLIGHT = Series(
    "rabbit_retry_in_flight",
    "gauge",
    ("queue",),
    "Deliveries being handled or waiting for their next home to confirm.",
)
PAUSED = Series(
    "rabbit_retry_paused",
    "gauge",
    ("queue",),
    "1 while a Pause holds the queue's consumer (its downstream fails), else 0.",
)
PAUSES = Series(
    "rabbit_retry_pauses_total", "counter", ("queue",), "Times a Pause stopped consuming the queue."
)
DUPLICATES = Series(
    "rabbit_retry_duplicates_total",
    "counter",
    ("queue",),
    "Deliveries acked without calling the handler: their idempotency key was done.",
)

INTERNAL_ERRORS = Series(
    "rabbit_retry_internal_errors_total",
    "counter",
    ("queue",),
    "Deliveries the worker's own code failed on (a bug): each was charged a failed attempt.",
)

HELD_KEYS = Series(
    "rabbit_retry_held_keys",
    "gauge",
    ("queue",),
    "Keys of an ordered queue held by a message waiting for a retry or parked, or waiting in "
    "a lane migrate added that has not opened yet, in the lanes this worker consumes.",
)
OLDEST_HELD = Series(
    "rabbit_retry_oldest_held_seconds",
    "gauge",
    ("queue",),
    "How long the longest-held key of an ordered queue has been held (0 when none is), in "
    "the lanes this worker consumes.",
)

WORKER = (MESSAGES, PARKED, HANDLER_SECONDS, IN_FLIGHT, PAUSED, PAUSES, DUPLICATES,
          INTERNAL_ERRORS, HELD_KEYS, OLDEST_HELD)

# --- the failure desk ----------------------------------------------------------------------------

DESK_PARKED = Series(
    "rabbit_retry_desk_parked",
    "gauge",
    ("queue", "reason"),
    "Messages parked now (in the desk's store, neither replayed nor discarded), by reason.",
)
DESK_OLDEST_PARKED_SECONDS = Series(
    "rabbit_retry_desk_oldest_parked_seconds",
    "gauge",
    ("queue",),
    "Age in seconds of the oldest message parked now; 0 when none is.",
)
DESK_INGESTED = Series(
    "rabbit_retry_desk_ingested_total",
    "counter",
    ("queue",),
    "Parked messages taken from the parking queue into the desk's store.",
)
DESK_REPLAYED = Series(
    "rabbit_retry_desk_replayed_total",
    "counter",
    ("queue",),
    "Parked messages an operator sent back to their queue.",
)
DESK_DISCARDED = Series(
    "rabbit_retry_desk_discarded_total",
    "counter",
    ("queue",),
    "Parked messages an operator discarded.",
)

DESK = (DESK_PARKED, DESK_OLDEST_PARKED_SECONDS, DESK_INGESTED, DESK_REPLAYED, DESK_DISCARDED)

# --- the outbox relay (README, "The outbox") -------------------------------------------------
# ``destination`` is where an event goes: its exchange, or the queue it was sent to straight.
# The gauges of events now are read from the outbox table at each scrape (every relay on one
# database reports the same: aggregate them with max); the rest are the relay process's own.

OUTBOX_PENDING = Series(
    "rabbit_retry_outbox_pending",
    "gauge",
    ("destination",),
    "Events added and not yet published, nor tried and failed.",
)
OUTBOX_FAILED = Series(
    "rabbit_retry_outbox_failed",
    "gauge",
    ("destination",),
    "Events the broker refused, waiting for their next try.",
)
OUTBOX_DEAD = Series(
    "rabbit_retry_outbox_dead",
    "gauge",
    ("destination",),
    "Events that failed every try; they wait for an operator to retry or discard them.",
)
OUTBOX_OLDEST_PENDING_SECONDS = Series(
    "rabbit_retry_outbox_oldest_pending_seconds",
    "gauge",
    ("destination",),
    "Age in seconds of the oldest event waiting to be published (pending or failed); 0: none.",
)
OUTBOX_PUBLISHED = Series(
    "rabbit_retry_outbox_published_total",
    "counter",
    ("destination",),
    "Events this relay published (the broker confirmed them).",
)
OUTBOX_FAILURES = Series(
    "rabbit_retry_outbox_failures_total",
    "counter",
    ("destination",),
    "Publishes the broker returned or refused (each try counts).",
)
OUTBOX_PUBLISH_SECONDS = Series(
    "rabbit_retry_outbox_publish_seconds",
    "histogram",
    ("destination",),
    "Time from an event's add to the broker's confirm of its publish.",
)
OUTBOX_HEARTBEAT = Series(
    "rabbit_retry_outbox_relay_heartbeat_seconds",
    "gauge",
    (),
    "Unix time of the relay's last round of work (it runs even while nothing is published).",
)
OUTBOX_PUBLISHING = Series(
    "rabbit_retry_outbox_relay_publishing",
    "gauge",
    (),
    "1 while the relay publishes; 0 while it waits for the broker or (SQLite) another relay.",
)

OUTBOX = (OUTBOX_PENDING, OUTBOX_FAILED, OUTBOX_DEAD, OUTBOX_OLDEST_PENDING_SECONDS,
          OUTBOX_PUBLISHED, OUTBOX_FAILURES, OUTBOX_PUBLISH_SECONDS, OUTBOX_HEARTBEAT,
          OUTBOX_PUBLISHING)
