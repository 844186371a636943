"""`rabbit-retry worker` imports only what its path uses: an idle worker's memory is its imports
(docs/worker-benchmark.md, "Idle memory"). The operators' verbs bring rich and httpx (click, the
command line, is allowed: about 1 MB, measured in bench.import_cost); the file's
parser and schema (ruamel.yaml, pydantic) run in a short-lived child; aio-pika is not needed
next to aiormq; prometheus-client only when metrics are served; tenacity only on a reconnect
or a retried publish; json on a payload's first read; a thread pool only for a blocking
handler; the idempotency machinery only for a consumer that declares it; the failure
path's copies at the first failure; OpenTelemetry only once something set a tracer provider
(the ``otel`` extra installed is not enough), and a worker without it runs as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from support.traces import WITHOUT_OTEL

from rabbit_retry import cli

TOPOLOGY = Path(__file__).resolve().parents[2] / "topologies" / "demo.yml"

# Never loaded by a worker started without --metrics-port whose consumers have no model.
HEAVY = (
    "aio_pika",
    "concurrent.futures.thread",
    "httpx",
    "json",
    "prometheus_client",
    "psycopg",
    "pydantic",
    "pydantic_core",
    "redis",
    "rich",
    "ruamel",
    "tenacity",
    "typing_extensions",
    "rabbit_retry.cli.operate",
    "rabbit_retry.metric_names",
    "rabbit_retry.cli.provision",
    "rabbit_retry.topology.load",
    "rabbit_retry.topology.model",
    "rabbit_retry.worker.copies",
    "rabbit_retry.worker.dedupe",
    "rabbit_retry.worker.stores",
    "opentelemetry",
    "rabbit_retry.tracing.carry",
    "rabbit_retry.worker.tracing",
)

CONSUMER = """
from rabbit_retry import Delivery, RetryConsumer


class Orders(RetryConsumer):
    queue = "demo.orders"

    async def handle(self, delivery: Delivery) -> None:
        pass
"""


TRACED_CONSUMER = CONSUMER + """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

trace.set_tracer_provider(TracerProvider())
"""

def _start(tmp_path: Path, *args: str, before: str = "") -> subprocess.CompletedProcess[str]:
    """The worker verb's whole start path short of the broker (nothing listens on port 1):
    the topology loaded, the consumer imported and checked, the runner built and connecting.
    Prints the modules of HEAVY (and the runner) that the process imported. ``before`` runs
    first."""
    (tmp_path / "lean_consumer.py").write_text(CONSUMER)
    (tmp_path / "traced_consumer.py").write_text(TRACED_CONSUMER)
    watched = (*HEAVY, "rabbit_retry.worker.runner", "rabbit_retry.worker.session")
    code = before + textwrap.dedent(f"""
        import atexit, sys
        atexit.register(lambda: print(sorted(
            m for m in {watched!r} if m in sys.modules)))
        from rabbit_retry.cli import main
        main(["--url", "amqp://guest:guest@127.0.0.1:1/", "worker", *{list(args)!r},
              "-t", {str(TOPOLOGY)!r}])
    """)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )


def test_the_worker_path_imports_nothing_it_does_not_use(tmp_path: Path) -> None:
    done = _start(tmp_path, "lean_consumer:Orders")
    # It got as far as the broker: the whole start path ran.
    assert "unreachable: connection refused" in done.stderr, done.stderr
    assert done.stdout.strip() == "['rabbit_retry.worker.runner', 'rabbit_retry.worker.session']"


def test_metrics_port_brings_prometheus_client(tmp_path: Path) -> None:
    # The positive control of the test above: the watch sees a module the path does import.
    done = _start(tmp_path, "lean_consumer:Orders", "--metrics-port", "0")
    assert "unreachable: connection refused" in done.stderr, done.stderr
    assert "prometheus_client" in done.stdout, done.stdout


def test_a_tracer_provider_set_in_the_consumer_module_brings_the_worker_tracing(
    tmp_path: Path,
) -> None:
    # The positive control of OpenTelemetry in HEAVY: the watch sees the tracing come in.
    done = _start(tmp_path, "traced_consumer:Orders")
    assert "unreachable: connection refused" in done.stderr, done.stderr
    assert "'rabbit_retry.worker.tracing'" in done.stdout, done.stdout


def test_without_opentelemetry_installed_the_worker_and_a_replay_run_as_before(
    tmp_path: Path,
) -> None:
    # Even where the environment names a provider to load, the worker starts untraced.
    env = {**os.environ, "OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}
    (tmp_path / "lean_consumer.py").write_text(CONSUMER)
    worker = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL + "from rabbit_retry.cli import main\n"
         f"main(['--url', 'amqp://guest:guest@127.0.0.1:1/', 'worker', 'lean_consumer:Orders',"
         f" '-t', {str(TOPOLOGY)!r}])\n"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert worker.stderr.strip().splitlines()[-1].endswith("unreachable: connection refused"), (
        worker.stderr)
    replay = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL + "from rabbit_retry.cli import main\n"
         "main(['--url', 'amqp://guest:guest@127.0.0.1:1/', '--management-url',"
         " 'http://127.0.0.1:1/', 'parking', 'replay', 'demo.orders', '--yes'])\n"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert replay.returncode == 1, replay.stderr
    assert "connection refused" in replay.stderr, replay.stderr
    assert "opentelemetry" not in worker.stderr + replay.stderr


def test_a_topology_problem_still_reads_as_before(tmp_path: Path) -> None:
    # The file is checked in a child process: its problems come back as the same lines.
    bad = tmp_path / "bad.yml"
    bad.write_text("version: 1\nqueues:\n  q:\n    retry: {max_attempts: 0}\n")
    code = (
        "from rabbit_retry.cli import main\n"
        f"main(['worker', 'x:Y', '-t', {str(bad)!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {bad}:4: queues.q.retry.max_attempts:"), done.stderr


def test_every_verb_is_defined_by_the_module_its_table_names() -> None:
    # `rabbit-retry VERB` imports only the module cli.VERBS names: each verb must be there.
    defined = {}
    for module in set(cli.VERBS.values()):
        for name, command in cli.commands_of(module).items():
            assert command.name == name
            defined[name] = module
    assert defined == cli.VERBS
