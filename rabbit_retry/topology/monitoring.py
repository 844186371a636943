"""A plan as monitoring: Prometheus alerting rules and a Grafana dashboard for its queues. Pure.

Both query only the series of ``rabbit_retry.metric_names`` (the worker's and the failure
desk's), labelled with the main queues' names. The alerts and their thresholds are listed in
docs/monitoring.md; keep the two in step.

Alert rules are written per queue, with the queue's name in every label matcher and in a
``queue`` label of the rule (rules of one alert differ by it), so each queue can be silenced,
routed or tuned on its own and a rule never matches a queue the topology does not declare.
Prometheus expands rule labels and annotations as Go templates: annotations name the queue
through ``$labels.queue``, and the ``queue`` label writes any ``{{`` of a name as a template
that prints it.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML

from rabbit_retry import metric_names as names
from rabbit_retry.topology.plan import Plan


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When each alert fires. Durations are PromQL durations (``5m``, ``1h``)."""

    parked_window: str = "5m"  # any message parked within this window
    oldest_parked_seconds: int = 3600  # the desk's oldest parked message is older than this
    retry_share: float = 0.2  # more than this share of a queue's deliveries end in a retry...
    retry_min_per_second: float = 0.01  # ...and at least this many retries a second (6 / 10 min)
    retry_window: str = "10m"  # rates over this window
    retry_for: str = "10m"  # ...for this long
    paused_for: str = "5m"  # a Pause holds the queue's consumer this long
    oldest_held_seconds: int = 1800  # an ordered queue's key has been held this long


DEFAULT_THRESHOLDS = Thresholds()

ALERT_GROUP = "rabbit-retry"


def promql_string(value: str) -> str:
    """``value`` as a PromQL string literal.

    A JSON string without ``ensure_ascii`` escapes exactly ``"``, ``\\`` and control characters
    (as ``\\n``, ``\\u0001``), all of which PromQL's Go-style string syntax reads back the same.
    """
    return json.dumps(value, ensure_ascii=False)


def template_literal(text: str) -> str:
    """``text`` as a Go template that prints it (Prometheus expands rule labels)."""
    return re.sub(r"\{\{", lambda _: '{{ "{{" }}', text)


def queue_names(plan: Plan) -> list[str]:
    """The main queues, sorted: what the worker and the desk label their series with."""
    return sorted(q.name for q in plan.main_queues)


# --- alerts -------------------------------------------------------------------------------------


def alert_rules(plan: Plan, thresholds: Thresholds = DEFAULT_THRESHOLDS,
                destinations: Sequence[str] = ()) -> dict[str, Any]:
    """A Prometheus rule file's content: one group, each alert once per queue of ``plan``
    (and with ``destinations``, the outbox's: ``outbox_rules``)."""
    rules = [rule for queue in queue_names(plan) for rule in _queue_rules(queue, thresholds)]
    if destinations:
        rules += outbox_rules(destinations)
    ordered = sorted({q.owner for q in plan.queues if q.role == "lane"})
    rules += [_held_rule(queue, thresholds) for queue in ordered]
    return {"groups": [{"name": ALERT_GROUP, "rules": rules}]}


def _held_rule(queue: str, t: Thresholds) -> dict[str, Any]:
    q = f"queue={promql_string(queue)}"
    return _rule(
        "RabbitRetryKeyHeldTooLong",
        f"max by (queue) ({names.OLDEST_HELD.name}{{{q}}}) > {t.oldest_held_seconds}",
        None,
        {"queue": template_literal(queue), "severity": "warning"},
        "{{ $labels.queue }}: a key has been held {{ $value | humanizeDuration }}",
        "A key of ordered queue {{ $labels.queue }} has waited "
        f"{{{{ $value | humanizeDuration }}}} (threshold {t.oldest_held_seconds}s) for a "
        "message parked (or retrying) before its later messages; they wait in the lane's held "
        "queue. Replay the parked message to let the key go on, or discard it to skip it.",
    )


def _queue_rules(queue: str, t: Thresholds) -> list[dict[str, Any]]:
    q = f"queue={promql_string(queue)}"
    labels = {"queue": template_literal(queue)}
    retried = (
        f'sum by (queue) (rate({names.MESSAGES.name}{{{q}, outcome="retried"}}[{t.retry_window}]))'
    )
    handled = f"sum by (queue) (rate({names.MESSAGES.name}{{{q}}}[{t.retry_window}]))"
    return [
        _rule(
            "RabbitRetryMessagesParked",
            f"sum by (queue, reason) (increase({names.PARKED.name}{{{q}}}[{t.parked_window}])) > 0",
            None,
            {**labels, "severity": "warning"},
            "{{ $labels.queue }}: messages parked ({{ $labels.reason }})",
            "Messages parked from queue {{ $labels.queue }} with reason {{ $labels.reason }} "
            f"in the last {t.parked_window}: about {{{{ $value | humanize }}}}. They wait in its "
            "parking queue (or the failure desk) until replayed or discarded.",
        ),
        _rule(
            "RabbitRetryParkedTooLong",
            f"max by (queue) ({names.DESK_OLDEST_PARKED_SECONDS.name}{{{q}}}) "
            f"> {t.oldest_parked_seconds}",
            None,
            {**labels, "severity": "warning"},
            "{{ $labels.queue }}: a parked message has waited {{ $value | humanizeDuration }}",
            "The oldest message parked from queue {{ $labels.queue }} has waited "
            f"{{{{ $value | humanizeDuration }}}} (threshold {t.oldest_parked_seconds}s). "
            "Fix its cause and replay it, or discard it, at the failure desk.",
        ),
        _rule(
            "RabbitRetryRetryRateHigh",
            f"({retried} / {handled}) > {t.retry_share} and {retried} > {t.retry_min_per_second}",
            t.retry_for,
            {**labels, "severity": "warning"},
            "{{ $labels.queue }}: {{ $value | humanizePercentage }} of deliveries are retried",
            f"Over the last {t.retry_window}, more than {t.retry_share:.0%} of the deliveries of "
            "queue {{ $labels.queue }} failed and went to a retry tier, for "
            f"{t.retry_for}. Messages that run out of attempts will park.",
        ),
        _rule(
            "RabbitRetryQueuePaused",
            f"max by (queue) ({names.PAUSED.name}{{{q}}}) == 1",
            t.paused_for,
            {**labels, "severity": "critical"},
            "{{ $labels.queue }}: consuming paused",
            "A Pause has held the consumer of queue {{ $labels.queue }} for more than "
            f"{t.paused_for}: its downstream keeps failing. Messages wait in the queue; one "
            "probe message is tried at a time until one succeeds.",
        ),
    ]


def _rule(
    alert: str,
    expr: str,
    for_: str | None,
    labels: dict[str, str],
    summary: str,
    description: str,
) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": alert, "expr": expr}
    if for_ is not None:
        rule["for"] = for_
    rule["labels"] = labels
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def to_alerts(plan: Plan, thresholds: Thresholds = DEFAULT_THRESHOLDS,
              destinations: Sequence[str] = ()) -> str:
    """``alert_rules`` as the YAML file Prometheus loads (``rule_files``)."""
    yaml = YAML()  # round-trip: keys stay in order (alert, expr, for, labels, annotations)
    yaml.width = 1 << 16  # one line per expression, never folded
    out = io.StringIO()
    out.write(
        "# Prometheus alerting rules for the queues of a rabbit-retry topology, written by\n"
        "# `rabbit-retry export FILE --format alerts`. Alerts and thresholds: docs/monitoring.md\n"
    )
    yaml.dump(alert_rules(plan, thresholds, destinations), out)
    return out.getvalue()


# --- Grafana ------------------------------------------------------------------------------------

_DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
_QUEUE = 'queue=~"$queue"'
_RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class _Panel:
    title: str
    description: str
    unit: str
    targets: Sequence[tuple[str, str]]  # (expr, legend)
    # Shows the exemplars a tracing worker attaches (their trace ids link to the traces).
    exemplars: bool = False


def _quantile(q: float) -> tuple[str, str]:
    bucket = f"{names.HANDLER_SECONDS.name}_bucket"
    expr = f"histogram_quantile({q}, sum by (queue, le) (rate({bucket}{{{_QUEUE}}}[{_RATE}])))"
    return expr, f"{{{{queue}}}} p{round(q * 100)}"


_PANELS = (
    _Panel(
        "Messages by outcome",
        "Deliveries a second, by what became of them: success, retried, parked.",
        "ops",
        [
            (
                f"sum by (queue, outcome) (rate({names.MESSAGES.name}{{{_QUEUE}}}[{_RATE}]))",
                "{{queue}} {{outcome}}",
            )
        ],
    ),
    _Panel(
        "Parked by reason",
        "Messages the workers parked, by reason (exhausted, permanent, invalid).",
        "short",
        [
            (
                f"sum by (queue, reason) (increase({names.PARKED.name}{{{_QUEUE}}}[{_RATE}]))",
                "{{queue}} {{reason}}",
            )
        ],
    ),
    _Panel(
        "Parked now (failure desk)",
        "Messages parked and neither replayed nor discarded yet.",
        "short",
        [
            (
                f"sum by (queue, reason) ({names.DESK_PARKED.name}{{{_QUEUE}}})",
                "{{queue}} {{reason}}",
            )
        ],
    ),
    _Panel(
        "Oldest parked message",
        "How long the oldest message parked now has waited.",
        "s",
        [(f"max by (queue) ({names.DESK_OLDEST_PARKED_SECONDS.name}{{{_QUEUE}}})", "{{queue}}")],
    ),
    _Panel(
        "Handler duration",
        "Time in the handler: median, 95th and 99th percentile. With traces on, each dot is an"
        " exemplar: the trace of a delivery that took that long.",
        "s",
        [_quantile(0.5), _quantile(0.95), _quantile(0.99)],
        exemplars=True,
    ),
    _Panel(
        "In flight",
        "Deliveries being handled or waiting for their next home to confirm.",
        "short",
        [(f"sum by (queue) ({names.IN_FLIGHT.name}{{{_QUEUE}}})", "{{queue}}")],
    ),
    _Panel(
        "Paused",
        "1 while a Pause holds the queue's consumer; pauses started in each interval.",
        "short",
        [
            (f"max by (queue) ({names.PAUSED.name}{{{_QUEUE}}})", "{{queue}} paused"),
            (
                f"sum by (queue) (increase({names.PAUSES.name}{{{_QUEUE}}}[{_RATE}]))",
                "{{queue}} pauses",
            ),
        ],
    ),
    _Panel(
        "Held keys (ordered queues)",
        "Keys waiting for an earlier message (retrying or parked), and the oldest one's wait.",
        "short",
        [
            (f"sum by (queue) ({names.HELD_KEYS.name}{{{_QUEUE}}})", "{{queue}} held keys"),
            (f"max by (queue) ({names.OLDEST_HELD.name}{{{_QUEUE}}})",
             "{{queue}} oldest held (s)"),
        ],
    ),
    _Panel(
        "Duplicates",
        "Deliveries acked without calling the handler: their idempotency key was done.",
        "ops",
        [
            (
                f"sum by (queue) (rate({names.DUPLICATES.name}{{{_QUEUE}}}[{_RATE}]))",
                "{{queue}}",
            )
        ],
    ),
    _Panel(
        "Worker internal errors",
        "Deliveries the worker's own code failed on (a bug to report): each was charged a "
        "failed attempt rather than left unacked.",
        "ops",
        [
            (
                f"sum by (queue) (rate({names.INTERNAL_ERRORS.name}{{{_QUEUE}}}[{_RATE}]))",
                "{{queue}}",
            )
        ],
    ),
    _Panel(
        "Failure desk: ingested, replayed, discarded",
        "Parked messages taken into the desk, and what operators did with them.",
        "ops",
        [
            (f"sum by (queue) (rate({series.name}{{{_QUEUE}}}[{_RATE}]))", f"{{{{queue}}}} {verb}")
            for series, verb in (
                (names.DESK_INGESTED, "ingested"),
                (names.DESK_REPLAYED, "replayed"),
                (names.DESK_DISCARDED, "discarded"),
            )
        ],
    ),
)


def dashboard(plan: Plan, title: str = "rabbit-retry",
              destinations: Sequence[str] = ()) -> dict[str, Any]:
    """A Grafana dashboard (schema 39) of ``plan``'s queues, for import or provisioning.

    The data source is the ``DS_PROMETHEUS`` variable, picked on the dashboard; ``queue`` is a
    multi-value variable listing the topology's queues. The uid follows from the queue names, so
    exporting the same topology again updates the same dashboard. With ``destinations`` it
    also has the outbox relay's panels (``OUTBOX_PANELS``) and a ``destination`` variable.
    """
    queues = queue_names(plan)
    uid = "rabbit-retry-" + hashlib.sha256(json.dumps(queues).encode()).hexdigest()[:12]
    panels = []
    shown = _PANELS + (OUTBOX_PANELS if destinations else ())
    for number, panel in enumerate(shown):
        panels.append(
            {
                "id": number + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": _DATASOURCE,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (number % 2), "y": 8 * (number // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"},
                },
                "targets": [
                    {
                        "datasource": _DATASOURCE,
                        "expr": expr,
                        "legendFormat": legend,
                        "refId": chr(ord("A") + i),
                        **({"exemplar": True} if panel.exemplars else {}),
                    }
                    for i, (expr, legend) in enumerate(panel.targets)
                ],
            }
        )
    return {
        "title": title,
        "uid": uid,
        "tags": ["rabbit-retry"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "templating": {"list": [_datasource_variable(), _queue_variable(queues),
                                *([_custom_variable("destination", "Destination",
                                                    sorted(destinations))]
                                  if destinations else [])]},
        "annotations": {"list": []},
        "panels": panels,
    }


def _datasource_variable() -> dict[str, Any]:
    return {
        "name": "DS_PROMETHEUS",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def _queue_variable(queues: Sequence[str]) -> dict[str, Any]:
    return _custom_variable("queue", "Queue", queues)


def _custom_variable(name: str, label: str, values: Sequence[str]) -> dict[str, Any]:
    # A custom variable's query is comma-separated; a comma inside a value is written "\,".
    return {
        "name": name,
        "label": label,
        "type": "custom",
        "query": ",".join(q.replace(",", "\\,") for q in values),
        "multi": True,
        "includeAll": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [{"selected": False, "text": q, "value": q} for q in values],
        "hide": 0,
    }


def to_grafana(plan: Plan, title: str = "rabbit-retry", destinations: Sequence[str] = ()) -> str:
    """``dashboard`` as JSON, keys sorted, so the same topology always gives the same text."""
    board = dashboard(plan, title, destinations)
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# --- the outbox relay ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboxThresholds:
    """When the outbox's alerts fire (docs/monitoring.md, "The outbox")."""

    oldest_pending_seconds: int = 300  # an event has waited this long to be published
    relay_silent_seconds: int = 120  # no relay has reported for this long...
    relay_memory: str = "1h"  # ...within this window (a relay gone longer has no series left)
    not_publishing_for: str = "5m"  # relays run but none publishes


DEFAULT_OUTBOX_THRESHOLDS = OutboxThresholds()


def outbox_rules(destinations: Sequence[str],
                 t: OutboxThresholds = DEFAULT_OUTBOX_THRESHOLDS) -> list[dict[str, Any]]:
    """The outbox relay's alerts: per destination, dead events and a backlog; for the relays,
    silence and not publishing."""
    rules = []
    for destination in sorted(destinations):
        d = f"destination={promql_string(destination)}"
        labels = {"destination": template_literal(destination)}
        rules += [
            _rule(
                "RabbitRetryOutboxDead",
                f"max by (destination) ({names.OUTBOX_DEAD.name}{{{d}}}) > 0",
                None,
                {**labels, "severity": "warning"},
                "{{ $labels.destination }}: outbox events dead",
                "{{ $value }} events to {{ $labels.destination }} failed every publish the "
                "relay tried (the broker returned or refused them). They wait in the outbox "
                "table: retry or discard them at the failure desk.",
            ),
            _rule(
                "RabbitRetryOutboxBacklog",
                f"max by (destination) ({names.OUTBOX_OLDEST_PENDING_SECONDS.name}{{{d}}}) "
                f"> {t.oldest_pending_seconds}",
                None,
                {**labels, "severity": "warning"},
                "{{ $labels.destination }}: an outbox event has waited "
                "{{ $value | humanizeDuration }}",
                "The oldest event to {{ $labels.destination }} not yet published has waited "
                f"{{{{ $value | humanizeDuration }}}} (threshold {t.oldest_pending_seconds}s): "
                "the relays are behind, stopped, or the broker keeps refusing it.",
            ),
        ]
    heartbeat = names.OUTBOX_HEARTBEAT.name
    rules += [
        _rule(
            "RabbitRetryOutboxRelaySilent",
            f"time() - max(max_over_time({heartbeat}[{t.relay_memory}])) "
            f"> {t.relay_silent_seconds}",
            None,
            {"severity": "critical"},
            "no outbox relay has reported for {{ $value | humanizeDuration }}",
            "No rabbit-retry relay has reported a heartbeat for "
            f"{{{{ $value | humanizeDuration }}}} (threshold {t.relay_silent_seconds}s): "
            "events the application commits are not being published.",
        ),
        _rule(
            "RabbitRetryOutboxNotPublishing",
            f"max({names.OUTBOX_PUBLISHING.name}) == 0",
            t.not_publishing_for,
            {"severity": "critical"},
            "outbox relays run but none publishes",
            f"For {t.not_publishing_for}, every rabbit-retry relay has been waiting: for the "
            "broker (unreachable, or refusing the connection) or, on SQLite, for another "
            "relay's lease.",
        ),
    ]
    return rules


_DESTINATION = 'destination=~"$destination"'


def _latency(q: float) -> tuple[str, str]:
    bucket = f"{names.OUTBOX_PUBLISH_SECONDS.name}_bucket"
    expr = (f"histogram_quantile({q}, sum by (destination, le) "
            f"(rate({bucket}{{{_DESTINATION}}}[{_RATE}])))")
    return expr, f"{{{{destination}}}} p{round(q * 100)}"


OUTBOX_PANELS = (
    _Panel(
        "Outbox: waiting to be published",
        "Events added and not published yet: pending, and failed (waiting for their next try).",
        "short",
        [(f"max by (destination) ({series.name}{{{_DESTINATION}}})",
          f"{{{{destination}}}} {status}")
         for series, status in ((names.OUTBOX_PENDING, "pending"),
                                (names.OUTBOX_FAILED, "failed"))],
    ),
    _Panel(
        "Outbox: oldest waiting event",
        "How long the oldest event not yet published has waited.",
        "s",
        [(f"max by (destination) ({names.OUTBOX_OLDEST_PENDING_SECONDS.name}{{{_DESTINATION}}})",
          "{{destination}}")],
    ),
    _Panel(
        "Outbox: published and refused",
        "Events the relays published a second, and publishes the broker returned or refused.",
        "ops",
        [(f"sum by (destination) (rate({series.name}{{{_DESTINATION}}}[{_RATE}]))",
          f"{{{{destination}}}} {what}")
         for series, what in ((names.OUTBOX_PUBLISHED, "published"),
                              (names.OUTBOX_FAILURES, "refused"))],
    ),
    _Panel(
        "Outbox: publish latency",
        "From an event's add to the broker's confirm: median, 95th and 99th percentile.",
        "s",
        [_latency(0.5), _latency(0.95), _latency(0.99)],
    ),
    _Panel(
        "Outbox: dead events",
        "Events that failed every try; an operator retries or discards them at the desk.",
        "short",
        [(f"max by (destination) ({names.OUTBOX_DEAD.name}{{{_DESTINATION}}})",
          "{{destination}}")],
    ),
    _Panel(
        "Outbox relays",
        "Seconds since each relay's last heartbeat, and whether it publishes (1) or waits (0).",
        "short",
        [(f"time() - {names.OUTBOX_HEARTBEAT.name}", "{{instance}} since heartbeat"),
         (names.OUTBOX_PUBLISHING.name, "{{instance}} publishing")],
    ),
)
