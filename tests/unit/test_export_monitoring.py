"""export --format alerts | grafana: Prometheus alerting rules and a Grafana dashboard.

The rules are proven with promtool (Debian's ``prometheus`` package): ``check rules`` parses and
lints them, ``test rules`` feeds series in and asserts which alerts fire, with which labels and
annotations. promtool missing fails these tests in CI and skips them locally.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from ruamel.yaml import YAML
from support.tools import require

from rabbit_retry import metric_names as names
from rabbit_retry.cli import main
from rabbit_retry.topology import Plan, Queue, compile_topology, parse_topology
from rabbit_retry.topology.monitoring import (
    DEFAULT_THRESHOLDS,
    alert_rules,
    dashboard,
    promql_string,
    template_literal,
    to_alerts,
    to_grafana,
)
from rabbit_retry.worker.metrics import Metrics

TOPOLOGY = """\
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.fraud-check:
    bindings: [{exchange: orders, routing_key: order.created}]
  "billing,eu:v2/@#+":
    retry: {delays: [10s], max_attempts: 3}
  audit: {}
"""
QUEUES = ["audit", "billing,eu:v2/@#+", "orders.fraud-check"]
ALERTS = {
    "RabbitRetryMessagesParked": "warning",
    "RabbitRetryParkedTooLong": "warning",
    "RabbitRetryRetryRateHigh": "warning",
    "RabbitRetryQueuePaused": "critical",
}
# A topology file cannot name a queue like this (AMQP's name rules), a hand-built plan can: the
# quote, backslash, braces and newline test every escape on the way.
ODD = 'we.ird "q" {{ $x }} \\ end'


def plan_of(text: str = TOPOLOGY) -> Plan:
    return compile_topology(parse_topology(text))


def plan_with(*queues: str) -> Plan:
    return Plan(
        exchanges=(),
        queues=tuple(Queue(name=q, role="main", owner=q) for q in queues),
        bindings=(),
    )


def load_yaml(text: str) -> Any:
    return YAML(typ="safe", pure=True).load(text)


# --- alerts -------------------------------------------------------------------------------------


def test_one_rule_per_queue_per_alert() -> None:
    (group,) = alert_rules(plan_of())["groups"]
    assert group["name"] == "rabbit-retry"
    seen = sorted((rule["alert"], rule["labels"]["queue"]) for rule in group["rules"])
    assert seen == sorted((alert, queue) for alert in ALERTS for queue in QUEUES)
    for rule in group["rules"]:
        queue = rule["labels"]["queue"]
        assert rule["labels"]["severity"] == ALERTS[rule["alert"]]
        assert f"queue={promql_string(queue)}" in rule["expr"]
        assert "{{ $labels.queue }}" in rule["annotations"]["summary"]
        assert "{{ $labels.queue }}" in rule["annotations"]["description"]


def test_thresholds_are_the_documented_defaults() -> None:
    (group,) = alert_rules(plan_of("version: 1\nqueues: {q: {}}\n"))["groups"]
    rules = {rule["alert"]: rule for rule in group["rules"]}
    assert rules["RabbitRetryMessagesParked"]["expr"].endswith("[5m])) > 0")
    assert "for" not in rules["RabbitRetryMessagesParked"]
    assert rules["RabbitRetryParkedTooLong"]["expr"].endswith("> 3600")
    assert rules["RabbitRetryQueuePaused"]["expr"].endswith("== 1")
    assert rules["RabbitRetryQueuePaused"]["for"] == "5m"
    assert rules["RabbitRetryRetryRateHigh"]["for"] == "10m"
    assert ") > 0.2 and " in rules["RabbitRetryRetryRateHigh"]["expr"]
    docs = (Path(__file__).parents[2] / "docs" / "monitoring.md").read_text(encoding="utf-8")
    for alert in ALERTS:
        assert f"`{alert}`" in docs
    assert DEFAULT_THRESHOLDS.oldest_parked_seconds == 3600


def test_the_file_is_the_rules_as_yaml_and_the_same_every_time() -> None:
    text = to_alerts(plan_of())
    assert text.startswith("# Prometheus alerting rules")
    assert load_yaml(text) == alert_rules(plan_of())
    reordered = TOPOLOGY.replace("  audit: {}\n", "").replace("queues:\n", "queues:\n  audit: {}\n")
    assert to_alerts(plan_of(reordered)) == text
    # One line per expression: nothing folded for a reader to unfold.
    assert all(line.startswith("  - alert:") for line in text.splitlines() if "alert:" in line)
    assert sum(line.lstrip().startswith("expr: ") for line in text.splitlines()) == 12


@pytest.mark.parametrize(
    ("name", "literal"),
    [
        ("orders.fraud-check", '"orders.fraud-check"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("new\nline\ttab", '"new\\nline\\ttab"'),
        ("ctl\x01", '"ctl\\u0001"'),
        ("ünï €", '"ünï €"'),
    ],
)
def test_queue_names_are_promql_string_literals(name: str, literal: str) -> None:
    assert promql_string(name) == literal


def test_a_queue_label_prints_braces_literally() -> None:
    assert template_literal("a {{ $x }} b") == 'a {{ "{{" }} $x }} b'
    assert template_literal("plain") == "plain"


def test_odd_queue_names_reach_every_expression_escaped() -> None:
    rules = alert_rules(plan_with(ODD))["groups"][0]["rules"]
    matcher = 'queue="we.ird \\"q\\" {{ $x }} \\\\ end"'
    assert all(matcher in rule["expr"] for rule in rules)
    assert all(rule["labels"]["queue"] == template_literal(ODD) for rule in rules)
    assert load_yaml(to_alerts(plan_with(ODD))) == alert_rules(plan_with(ODD))


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = require("promtool", installed_by="apt-get install prometheus")
    rules = tmp_path / "alerts.yml"
    rules.write_text(to_alerts(plan_with(*QUEUES, ODD)), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {4 * (len(QUEUES) + 1)} rules found" in result.stdout


def _series(metric: str, values: str, **labels: str) -> dict[str, str]:
    matchers = ", ".join(f"{k}={promql_string(v)}" for k, v in labels.items())
    return {"series": f"{metric}{{{matchers}}}", "values": values}


def _expect(at: str, alert: str, *alerts: dict[str, Any]) -> dict[str, Any]:
    """At minute ``at``, exactly ``alerts`` of ``alert`` fire (none: a negative control)."""
    return {"eval_time": at, "alertname": alert, "exp_alerts": list(alerts)}


def _firing(labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    return {
        "exp_labels": labels,
        "exp_annotations": {"summary": summary, "description": description},
    }


def _promtool_test(
    tmp_path: Path, plan: Plan, series: list[dict[str, str]], expected: list[dict[str, Any]]
) -> None:
    """Runs ``promtool test rules``: the rules of ``plan``, ``series`` sampled every minute."""
    promtool = require("promtool", installed_by="apt-get install prometheus")
    (tmp_path / "alerts.yml").write_text(to_alerts(plan), encoding="utf-8")
    spec = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": expected}],
    }
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(json.dumps(spec, indent=1), encoding="utf-8")  # JSON is YAML
    result = subprocess.run(
        [promtool, "test", "rules", str(tests)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _minutes(*ones: range, last: int = 20) -> str:
    """A series' values, one a minute: 1 in the given minutes, else 0."""
    return " ".join("1" if any(m in r for r in ones) else "0" for m in range(last + 1))


def _parked(queue: str) -> dict[str, Any]:
    return _firing(
        {"severity": "warning", "queue": queue, "reason": "exhausted"},
        f"{queue}: messages parked (exhausted)",
        f"Messages parked from queue {queue} with reason exhausted in the last 5m: about 1. "
        "They wait in its parking queue (or the failure desk) until replayed or discarded.",
    )


def _paused(queue: str) -> dict[str, Any]:
    return _firing(
        {"severity": "critical", "queue": queue},
        f"{queue}: consuming paused",
        f"A Pause has held the consumer of queue {queue} for more than 5m: its downstream "
        "keeps failing. Messages wait in the queue; one probe message is tried at a time until "
        "one succeeds.",
    )


def test_promtool_proves_the_parked_and_paused_rules_fire(tmp_path: Path) -> None:
    """For an ordinary and an odd queue name, with controls both ways: parked fires while the
    5 m window holds the park, not before or after; paused fires after 5 minutes at 1, not
    sooner, not once it is 0 again, and not for the queue that paused for 3 minutes."""
    ordinary = "orders.fraud-check"
    parked_at_3 = _minutes(range(3, 21))  # the counter goes 0 -> 1 at minute 3
    series = [
        _series(names.PARKED.name, parked_at_3, queue=ordinary, reason="exhausted"),
        _series(names.PARKED.name, parked_at_3, queue=ODD, reason="exhausted"),
        _series(names.PAUSED.name, _minutes(range(2, 13)), queue=ODD, instance="w1"),
        _series(names.PAUSED.name, _minutes(range(2, 5)), queue=ordinary, instance="w1"),
    ]
    parked, paused = "RabbitRetryMessagesParked", "RabbitRetryQueuePaused"
    _promtool_test(
        tmp_path,
        plan_with(ordinary, ODD),
        series,
        [
            _expect("2m", parked),
            _expect("5m", parked, _parked(ordinary), _parked(ODD)),
            _expect("15m", parked),
            _expect("6m", paused),
            _expect("8m", paused, _paused(ODD)),
            _expect("14m", paused),
        ],
    )


def test_promtool_proves_the_oldest_parked_rule_fires(tmp_path: Path) -> None:
    """The desk's oldest parked message ages 10 minutes a minute: over an hour from minute 7."""
    queue = "orders.fraud-check"
    ages = " ".join(str(600 * m) for m in range(21))
    too_long = "RabbitRetryParkedTooLong"
    _promtool_test(
        tmp_path,
        plan_with(queue),
        [_series(names.DESK_OLDEST_PARKED_SECONDS.name, ages, queue=queue)],
        [
            _expect("6m", too_long),
            _expect(
                "7m",
                too_long,
                _firing(
                    {"severity": "warning", "queue": queue},
                    f"{queue}: a parked message has waited 1h 10m 0s",
                    f"The oldest message parked from queue {queue} has waited 1h 10m 0s "
                    "(threshold 3600s). Fix its cause and replay it, or discard it, at the "
                    "failure desk.",
                ),
            ),
        ],
    )


def test_promtool_proves_the_retry_rate_rule_fires(tmp_path: Path) -> None:
    """Half the deliveries retried fires after 10 minutes of it; a trickle of retries (with
    no success at all) does not."""
    ramp = " ".join(str(60 * m) for m in range(21))  # one a second
    trickle = " ".join(str(m // 5) for m in range(21))  # one every 5 minutes: under 0.01/s
    retry_rate = "RabbitRetryRetryRateHigh"
    _promtool_test(
        tmp_path,
        plan_with("busy", "quiet"),
        [
            _series(names.MESSAGES.name, ramp, queue="busy", outcome="success"),
            _series(names.MESSAGES.name, ramp, queue="busy", outcome="retried"),
            _series(names.MESSAGES.name, "0x20", queue="quiet", outcome="success"),
            _series(names.MESSAGES.name, trickle, queue="quiet", outcome="retried"),
        ],
        [
            _expect("8m", retry_rate),
            _expect(
                "15m",
                retry_rate,
                _firing(
                    {"severity": "warning", "queue": "busy"},
                    "busy: 50% of deliveries are retried",
                    "Over the last 10m, more than 20% of the deliveries of queue busy failed and "
                    "went to a retry tier, for 10m. Messages that run out of attempts will park.",
                ),
            ),
        ],
    )


# --- Grafana ------------------------------------------------------------------------------------


def test_dashboard_is_valid_json_with_the_variables_and_panels() -> None:
    text = to_grafana(plan_of())
    board = json.loads(text)
    assert board == json.loads(json.dumps(dashboard(plan_of())))
    assert board["schemaVersion"] == 39
    source, queue = board["templating"]["list"]
    assert (source["name"], source["type"], source["query"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )
    assert queue["name"] == "queue" and queue["multi"] and queue["includeAll"]
    assert [o["value"] for o in queue["options"]] == QUEUES
    # Grafana splits a custom variable's query at commas not written "\,".
    assert queue["query"] == "audit,billing\\,eu:v2/@#+,orders.fraud-check"
    titles = [p["title"] for p in board["panels"]]
    assert titles == [
        "Messages by outcome",
        "Parked by reason",
        "Parked now (failure desk)",
        "Oldest parked message",
        "Handler duration",
        "In flight",
        "Paused",
        "Held keys (ordered queues)",
        "Duplicates",
        "Worker internal errors",
        "Failure desk: ingested, replayed, discarded",
    ]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    cells = [
        (p["gridPos"]["x"] // 12, p["gridPos"]["y"] // 8) for p in board["panels"]
    ]  # no two panels on one spot
    assert len(set(cells)) == len(cells)
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert 'queue=~"$queue"' in target["expr"]
    duration = next(p for p in board["panels"] if p["title"] == "Handler duration")
    assert [t["expr"].split(",")[0] for t in duration["targets"]] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
        "histogram_quantile(0.99",
    ]
    # A tracing worker's exemplars show on it, and only on it (a trace id per bucket).
    assert [t.get("exemplar") for t in duration["targets"]] == [True] * 3
    assert {t.get("exemplar") for p in board["panels"] if p is not duration
            for t in p["targets"]} == {None}
    assert to_grafana(plan_of()) == text  # stable
    assert board["uid"] == dashboard(plan_of())["uid"] != dashboard(plan_with("other"))["uid"]


# --- metric names: what the exports query is what the worker and the desk expose ----------------


def _exposed(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


def _worker_samples() -> set[str]:
    metrics = Metrics()
    metrics.for_queue("q").handler_seconds.observe(0.1)
    return _exposed(metrics.registry)


def _desk_samples() -> set[str]:
    """A registry built from the desk's specs, as the desk will build it."""
    registry = CollectorRegistry()
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    for series in names.DESK:
        metric = kinds[series.kind](series.name, series.help, series.labels, registry=registry)
        metric.labels(*["x"] * len(series.labels))
    return _exposed(registry)


def _queried(expr: str) -> set[str]:
    return set(re.findall(r"\brabbit_retry_[a-z_]+", expr))


def _every_expr() -> list[str]:
    rules = alert_rules(plan_of())["groups"][0]["rules"]
    board = dashboard(plan_of())
    return [r["expr"] for r in rules] + [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_exports_query_only_series_the_worker_or_the_desk_expose() -> None:
    exposed = _worker_samples() | _desk_samples()
    queried = set().union(*map(_queried, _every_expr()))
    assert queried <= exposed, queried - exposed
    # Every series of the README's list is on the dashboard.
    board = dashboard(plan_of())
    on_board = set().union(*(_queried(t["expr"]) for p in board["panels"] for t in p["targets"]))
    for series in (*names.WORKER, *names.DESK):
        suffix = "_bucket" if series.kind == "histogram" else ""
        assert series.name + suffix in on_board


def test_the_worker_registry_exposes_each_spec_with_its_labels() -> None:
    metrics = Metrics()
    metrics.for_queue("q")
    families = {family.name: family for family in metrics.registry.collect()}
    for series in names.WORKER:
        base = series.name.removesuffix("_total")
        assert families[base].type == series.kind
        labels = {key for sample in families[base].samples for key in sample.labels}
        assert labels - {"le"} == set(series.labels)
        assert any(s.name.startswith(series.name) for s in families[base].samples)


# --- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["alerts", "grafana"])
def test_export_command_writes_the_document(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = tmp_path / "shop.yml"
    topology.write_text(TOPOLOGY, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(topology), "--format", fmt])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # The outbox's destinations of the file (an exchange, the queues): its rules and panels too.
    destinations = ["audit", "billing,eu:v2/@#+", "orders", "orders.fraud-check"]
    if fmt == "alerts":
        assert out == to_alerts(plan_of(), destinations=destinations)
    else:
        assert out == to_grafana(plan_of(), title="rabbit-retry: shop",
                                 destinations=destinations)
        assert json.loads(out)["title"] == "rabbit-retry: shop"
    written = tmp_path / "out.txt"
    with pytest.raises(SystemExit):
        main(["export", str(topology), "--format", fmt, "--out", str(written)])
    assert written.read_text(encoding="utf-8") == out


def test_export_of_a_bad_file_says_why_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = tmp_path / "bad.yml"
    topology.write_text("version: 1\nqueues:\n  q: {retry: {max_attempts: 0}}\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(topology), "--format", "alerts"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "max_attempts: must be at least 1, got 0" in captured.err


def test_an_ordered_queue_gets_an_alert_when_a_key_is_held_too_long() -> None:
    from rabbit_retry.topology import compile_topology, parse_topology

    plan = compile_topology(parse_topology("""\
version: 1
queues:
  plain: {}
  rewards.points:
    ordered: {key: {header: user-id}, lanes: 2}
"""))
    rules = alert_rules(plan)["groups"][0]["rules"]
    held = [r for r in rules if r["alert"] == "RabbitRetryKeyHeldTooLong"]
    assert [r["labels"]["queue"] for r in held] == ["rewards.points"]  # ordered queues only
    assert held[0]["expr"] == (
        'max by (queue) (rabbit_retry_oldest_held_seconds{queue="rewards.points"}) > 1800')
