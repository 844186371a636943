"""The topology corpus through ``rabbit-retry apply`` on the real broker: every malformed file is
refused before anything is touched, every good one applies and then has nothing left to do."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

CORPUS = Path(__file__).resolve().parents[1] / "unit" / "corpus"
BAD = sorted((CORPUS / "bad").glob("*.yml"))
GOOD = sorted((CORPUS / "good").glob("*.yml"))
RunCli = Callable[..., Any]  # the run_cli fixture of tests/conftest.py


def _expected() -> dict[str, Any]:
    path = CORPUS / "expected.yml"
    if not path.exists():
        return {}
    loaded = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    return dict(loaded or {})


EXPECTED = _expected()


@pytest.fixture(scope="module")
def corpus_vhost(vhost_factory: Callable[[], Settings]) -> Settings:
    # One vhost for every bad file: each test asserts it is still empty afterwards.
    return vhost_factory()


def _objects(api: Management, settings: Settings) -> tuple[list[str], list[str]]:
    queues = [q["name"] for q in api.queues(settings.vhost)]
    exchanges = [
        e["name"]
        for e in api.exchanges(settings.vhost)
        if e["name"] and not e["name"].startswith("amq.")
    ]
    return queues, exchanges


@pytest.mark.parametrize("path", BAD, ids=[p.name for p in BAD])
def test_bad_file_is_refused_before_the_broker_is_touched(
    path: Path, corpus_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    result = run_cli("apply", str(path), settings=corpus_vhost)
    assert result.code == 2, result.err
    assert result.out == ""
    assert "Traceback" not in result.err
    lines = result.err.splitlines()
    assert lines
    where = re.compile(rf"^error: {re.escape(str(path))}:\d+: \S")
    for line in lines:
        assert where.match(line), line
    expected = EXPECTED.get(path.name)
    if expected is not None:
        assert any(line.startswith(f"error: {path}:{expected['line']}: ") for line in lines)
        assert any(expected["fragment"] in line for line in lines)
    assert _objects(management, corpus_vhost) == ([], [])


@pytest.mark.parametrize("path", GOOD, ids=[p.name for p in GOOD])
def test_good_file_applies_and_then_has_nothing_to_do(
    path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    first = run_cli("apply", str(path), settings=fresh_vhost)
    assert first.code == 0, first.err
    assert first.out.startswith("created ")
    again = run_cli("apply", str(path), settings=fresh_vhost)
    assert (again.code, again.err) == (0, "")
    assert again.out == f"nothing to do: vhost {fresh_vhost.vhost!r} already matches {path}\n"
    plan = run_cli("plan", str(path), "--detailed-exitcode", settings=fresh_vhost)
    assert plan.code == 0, plan.out
    # Compact: no change listed, one line counting the unchanged objects, the summary.
    lines = plan.out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("unchanged: "), plan.out
