"""The outbox relay in ``export --format alerts|grafana``: its rules, proven with promtool (they
fire on the series the relay exposes, and not before), its panels, and the relay's ``/metrics``
exposing every series they query."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from support.tools import require

from rabbit_retry import metric_names as names
from rabbit_retry.outbox.metrics import RelayMetrics
from rabbit_retry.outbox.store import Figures
from rabbit_retry.topology import Plan, compile_topology, parse_topology
from rabbit_retry.topology.monitoring import (
    alert_rules,
    dashboard,
    outbox_rules,
    promql_string,
    to_alerts,
)

TOPOLOGY = """\
version: 1
exchanges:
  shop: {type: topic}
queues:
  shop.orders: {bindings: [{exchange: shop, routing_key: "order.*"}]}
"""
DESTINATIONS = ["shop", "shop.orders"]


def _plan() -> Plan:
    return compile_topology(parse_topology(TOPOLOGY))


def test_the_outbox_rules_come_with_the_destinations_only() -> None:
    plain = alert_rules(_plan())["groups"][0]["rules"]
    both = alert_rules(_plan(), destinations=DESTINATIONS)["groups"][0]["rules"]
    assert both[:len(plain)] == plain
    added = [(r["alert"], r["labels"].get("destination")) for r in both[len(plain):]]
    assert added == [("RabbitRetryOutboxDead", "shop"), ("RabbitRetryOutboxBacklog", "shop"),
                     ("RabbitRetryOutboxDead", "shop.orders"),
                     ("RabbitRetryOutboxBacklog", "shop.orders"),
                     ("RabbitRetryOutboxRelaySilent", None),
                     ("RabbitRetryOutboxNotPublishing", None)]
    for rule in both[len(plain):]:
        destination = rule["labels"].get("destination")
        if destination is not None:
            assert f"destination={promql_string(destination)}" in rule["expr"]
    docs = (Path(__file__).parents[2] / "docs" / "monitoring.md").read_text(encoding="utf-8")
    for alert in {a for a, _ in added}:
        assert f"`{alert}`" in docs


def _promtool(tmp_path: Path, series: list[dict[str, str]], expected: list[dict[str, Any]]
              ) -> None:
    promtool = require("promtool", installed_by="apt-get install prometheus")
    (tmp_path / "alerts.yml").write_text(to_alerts(_plan(), destinations=DESTINATIONS),
                                         encoding="utf-8")
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "alerts.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    spec = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": expected}]}
    (tmp_path / "test.yml").write_text(json.dumps(spec), encoding="utf-8")
    result = subprocess.run([promtool, "test", "rules", "test.yml"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _series(metric: str, values: str, **labels: str) -> dict[str, str]:
    matchers = ", ".join(f"{k}={promql_string(v)}" for k, v in labels.items())
    return {"series": f"{metric}{{{matchers}}}", "values": values}


def _at(minute: str, alert: str, *firing: tuple[dict[str, str], str, str]) -> dict[str, Any]:
    """At ``minute`` exactly ``firing`` (labels, summary, description) of ``alert`` fire (none:
    a negative control)."""
    return {"eval_time": minute, "alertname": alert, "exp_alerts": [
        {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": text}}
        for labels, summary, text in firing]}


def test_promtool_proves_dead_and_backlog_fire_per_destination(tmp_path: Path) -> None:
    dead = "0 0 0 2 2 2 0 0 0 0 0"  # two dead from minute 3, retried at minute 6
    ages = " ".join(str(60 * m) for m in range(11))  # the oldest waits a minute more a minute
    _promtool(tmp_path, [
        _series(names.OUTBOX_DEAD.name, dead, destination="shop", instance="r1"),
        _series(names.OUTBOX_DEAD.name, "0+0x10", destination="shop.orders", instance="r1"),
        _series(names.OUTBOX_OLDEST_PENDING_SECONDS.name, ages, destination="shop.orders",
                instance="r1"),
    ], [
        _at("2m", "RabbitRetryOutboxDead"),
        _at("4m", "RabbitRetryOutboxDead", (
            {"severity": "warning", "destination": "shop"}, "shop: outbox events dead",
            "2 events to shop failed every publish the relay tried (the broker returned or "
            "refused them). They wait in the outbox table: retry or discard them at the "
            "failure desk.")),
        _at("7m", "RabbitRetryOutboxDead"),
        _at("5m", "RabbitRetryOutboxBacklog"),  # 300 s is not more than 300 s
        _at("6m", "RabbitRetryOutboxBacklog", (
            {"severity": "warning", "destination": "shop.orders"},
            "shop.orders: an outbox event has waited 6m 0s",
            "The oldest event to shop.orders not yet published has waited 6m 0s (threshold "
            "300s): the relays are behind, stopped, or the broker keeps refusing it.")),
    ])


def test_promtool_proves_the_relay_rules_fire(tmp_path: Path) -> None:
    """A relay's heartbeat stops at minute 3 (its series ends): silent from minute 6 (more than
    120 s), for as long as the hour's memory holds it. Another relay publishes 0 from minute 2
    while the first publishes until minute 3: not publishing 5 minutes after the last one
    stopped, not before."""
    beats = " ".join(str(60 * m) for m in range(4))  # unix times 0, 60, 120, 180, then gone
    _promtool(tmp_path, [
        _series(names.OUTBOX_HEARTBEAT.name, beats, instance="r1"),
        _series(names.OUTBOX_PUBLISHING.name, "1 1 1 1 0 0 0 0 0 0 0 0 0", instance="r1"),
        _series(names.OUTBOX_PUBLISHING.name, "1 1 0 0 0 0 0 0 0 0 0 0 0", instance="r2"),
    ], [
        _at("4m", "RabbitRetryOutboxRelaySilent"),
        _at("6m", "RabbitRetryOutboxRelaySilent", (
            {"severity": "critical"}, "no outbox relay has reported for 3m 0s",
            "No rabbit-retry relay has reported a heartbeat for 3m 0s (threshold 120s): events "
            "the application commits are not being published.")),
        _at("8m", "RabbitRetryOutboxNotPublishing"),
        _at("10m", "RabbitRetryOutboxNotPublishing", (
            {"severity": "critical"}, "outbox relays run but none publishes",
            "For 5m, every rabbit-retry relay has been waiting: for the broker (unreachable, or "
            "refusing the connection) or, on SQLite, for another relay's lease.")),
    ])


def test_the_dashboard_has_the_outbox_panels_and_a_destination_variable() -> None:
    plain = dashboard(_plan())
    board = dashboard(_plan(), destinations=DESTINATIONS)
    assert board["panels"][:len(plain["panels"])] == plain["panels"]
    added = board["panels"][len(plain["panels"]):]
    assert [p["title"] for p in added] == [
        "Outbox: waiting to be published", "Outbox: oldest waiting event",
        "Outbox: published and refused", "Outbox: publish latency", "Outbox: dead events",
        "Outbox relays"]
    variable = board["templating"]["list"][-1]
    assert (variable["name"], [o["value"] for o in variable["options"]]) == (
        "destination", DESTINATIONS)
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in board["panels"]]
    assert len(set(cells)) == len(cells)
    for panel in added[:-1]:
        assert all('destination=~"$destination"' in t["expr"] for t in panel["targets"])


def test_the_relay_exposes_every_series_the_exports_query() -> None:
    figures = Figures(pending={"shop": 2}, failed={"shop": 1}, dead={"shop.orders": 1},
                      oldest={"shop": datetime.now(UTC) - timedelta(seconds=30)})
    metrics = RelayMetrics(DESTINATIONS, lambda: figures)
    metrics.confirmed("shop", datetime.now(UTC) - timedelta(seconds=1), datetime.now(UTC))
    metrics.failed("shop")
    exposed = {s.name for family in metrics.collect() for s in family.samples}
    rules = outbox_rules(DESTINATIONS)
    board = dashboard(_plan(), destinations=DESTINATIONS)
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in board["panels"]
                                          for t in p["targets"] if "outbox" in t["expr"]]
    queried = set().union(*(set(re.findall(r"\brabbit_retry_outbox_[a-z_]+", e)) for e in exprs))
    assert queried <= exposed, queried - exposed
    for series in names.OUTBOX:  # and every series of the relay is used somewhere
        suffix = "_bucket" if series.kind == "histogram" else ""
        assert series.name + suffix in queried, series.name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.collect() for s in family.samples}
    assert samples[("rabbit_retry_outbox_pending", (("destination", "shop"),))] == 2
    assert samples[("rabbit_retry_outbox_pending", (("destination", "shop.orders"),))] == 0
    assert samples[("rabbit_retry_outbox_dead", (("destination", "shop.orders"),))] == 1
    assert 29 <= samples[("rabbit_retry_outbox_oldest_pending_seconds",
                          (("destination", "shop"),))] <= 3600
    assert samples[("rabbit_retry_outbox_published_total", (("destination", "shop"),))] == 1
    assert samples[("rabbit_retry_outbox_failures_total", (("destination", "shop"),))] == 1
