"""The malformed topology corpus (tests/unit/corpus/bad/, see its README) through the installed
``rabbit-retry validate`` and ``rabbit-retry apply`` commands, each a separate process.

tests/unit/test_corpus.py checks the loader's message for every file and
tests/integration/test_provision_corpus.py runs ``apply`` in-process against an empty vhost;
this adds what only a real process shows (exit status, the whole of stderr, no traceback), the
``validate`` verb, and a vhost that already holds a topology: its complete definitions are the
same before and after all 84 refusals.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rel_support import HERE
from ruamel.yaml import YAML
from support.process import Ran, apply, cli

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

CORPUS = Path(__file__).resolve().parents[1] / "unit" / "corpus"
BAD = sorted((CORPUS / "bad").glob("*.yml"))
EXPECTED: dict[str, Any] = dict(YAML(typ="safe").load((CORPUS / "expected.yml").read_text()))
EXISTING = CORPUS / "good" / "all-options.yml"


def _definitions(api: Management, settings: Settings) -> dict[str, Any]:
    definitions = api.definitions(settings.vhost)
    for key in ("rabbit_version", "rabbitmq_version"):
        definitions.pop(key, None)
    return definitions


def _forked(settings: Settings, jobs: list[list[str]], tmp_path: Path) -> list[Ran]:
    """Each job in its own process through ``forked_cli.py`` (the command imported once)."""
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    prefix = ["--url", settings.url, "--management-url", settings.management_url]
    jobs_file.write_text(json.dumps([prefix + job for job in jobs]))
    done = subprocess.run([sys.executable, str(HERE / "forked_cli.py"), str(jobs_file),
                           str(results_file)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return [Ran(r["code"], r["out"], r["err"]) for r in json.loads(results_file.read_text())]


def _problem(verb: str, path: Path, result: Ran) -> str | None:
    want = EXPECTED[path.name]
    prefix = f"error: {path}:{want['line']}: " + (f"{want['key']}: " if "key" in want else "")
    lines = result.err.splitlines()
    if (result.code, result.out, len(lines)) != (2, "", 1):
        return f"{verb} {path.name}: exit {result.code}, stdout {result.out!r}, " \
               f"stderr {result.err!r}"
    if not (lines[0].startswith(prefix) and want["fragment"] in lines[0]):
        return f"{verb} {path.name}: {lines[0]!r} is not {prefix}...{want['fragment']}"
    if "Traceback" in result.err or not re.match(r"^error: \S", lines[0]):
        return f"{verb} {path.name}: {result.err!r}"
    return None


def test_every_malformed_file_is_one_located_line_exit_2_and_the_broker_is_untouched(
    fresh_vhost: Settings, management: Management, tmp_path: Path
) -> None:
    started = time.monotonic()
    assert len(BAD) >= 30 and len(BAD) == len(EXPECTED)
    apply(fresh_vhost, EXISTING)  # something the refusals must leave exactly as it is
    before = _definitions(management, fresh_vhost)
    assert before["queues"]

    jobs = [(verb, path) for path in BAD for verb in ("validate", "apply")]
    results = _forked(fresh_vhost, [[verb, str(path)] for verb, path in jobs], tmp_path)
    problems = [p for (verb, path), r in zip(jobs, results, strict=True)
                if (p := _problem(verb, path, r)) is not None]
    assert problems == []

    # The installed `rabbit-retry` script says exactly the same, byte for byte (a sample: each
    # start of the script costs its imports).
    sample = [(verb, path) for path in BAD[:: len(BAD) // 5] for verb in ("validate", "apply")]
    by_job = dict(zip(jobs, results, strict=True))
    for verb, path in sample:
        assert cli(fresh_vhost, verb, str(path)) == by_job[(verb, path)], (verb, path)

    assert _definitions(management, fresh_vhost) == before
    print(f"[reliability] topology corpus: {len(BAD)} files x validate/apply = {len(jobs)} "
          f"processes (+{len(sample)} through the installed script), each exit 2 with one "
          f"located line, vhost definitions unchanged; {time.monotonic() - started:.1f}s")
