"""A tiny run of the benchmark harness (``python -m bench.run --smoke``): it runs every benchmark
with a handful of messages and writes the report. Asserts the report's shape and that the run
cleans up after itself; never anything about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

pytestmark = pytest.mark.integration

for _needed in ("matplotlib", "psutil", "dramatiq", "faststream"):
    pytest.importorskip(
        _needed, reason="the bench extra is not installed: pip install -e '.[bench]'"
    )

REPO = Path(__file__).resolve().parent.parent
# Rows x columns of each table the harness itself builds (bench_worker and bench_apply belong to
# other modules: only their presence is checked).
SHAPES = {
    "retry": (["rabbit-retry worker", "bare aio-pika"], 3),
    "storm": (["rabbit-retry worker", "Dramatiq"], 8),
    "peers": (["rabbit-retry worker", "Dramatiq", "FastStream"], 6),
    "replay": (
        [
            "rabbit-retry parking replay",
            "bare confirmed-publish loop",
            "bare, pipelined (reference)",
        ],
        3,
    ),
    "resilience": (["no idempotency", "SQLite", "PostgreSQL", "Redis"], 4),
    "migrate": (["rabbit-retry migrate", "bare shovel-style move"], 3),
    "tracing": (["tracing off", "tracing on", "tracing on, not sampled"], 4),
    "batch": (["handle_batch (batch 500)", "handle (one at a time)"], 3),
    "ordered": (["ordered (1,000 keys, 4 lanes)", "plain queue"], 3),
}


def test_smoke_run_writes_the_report_and_leaves_no_vhost(
    tmp_path: Path, management: Management, session_vhost: Settings
) -> None:
    run_id = "smoke" + uuid.uuid4().hex[:6]
    out = tmp_path / "benchmarks.md"
    env = {
        **os.environ,
        "BENCH_RUN_ID": run_id,
        # The harness makes vhosts of its own; it only takes the broker from this URL.
        "RABBIT_RETRY_URL": session_vhost.url,
        "RABBIT_RETRY_MANAGEMENT_URL": session_vhost.management_url,
    }
    # A deadline so a hang fails the test instead of the suite; not a statement about speed.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--out",
            str(out),
            "--results",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    report = json.loads((tmp_path / "run.json").read_text())
    benches = report["benches"]
    assert list(benches) == ["worker", "retry", "storm", "peers", "apply", "replay", "desk",
                             "outbox", "resilience", "cluster", "ordered", "batch", "migrate",
                             "tracing"]
    for key, (systems, width) in SHAPES.items():
        result = benches[key]["result"]
        assert [row[0] for row in result["rows"]] == systems, key
        assert all(len(row) == width == len(result["columns"]) for row in result["rows"]), key
    # cluster: measured when scripts/cluster.sh's cluster is up, otherwise a note says why.
    for key in ("worker", "apply", "desk", "outbox", "cluster"):
        assert "error" not in benches[key], benches[key].get("error")
        assert "result" in benches[key] or "missing" in benches[key]
    machine = report["machine"]
    assert machine["nproc"] and machine["broker"]["rabbitmq"]

    text = out.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "Smoke run" in text
    assert f"RabbitMQ {machine['broker']['rabbitmq']}" in text
    for heading in ("## Setup", "## Summary", "## 2. Retry path", "## 3. Retry storm"):
        assert heading in text
    images = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(images) >= 5
    for name in images:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    names = [v["name"] for v in management.get("/vhosts")]
    assert [n for n in names if n.startswith(f"rr-bench-{run_id}-")] == []
