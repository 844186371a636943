"""`rabbit-retry worker` imports only its own verb: an idle worker's memory is its imports
(docs/worker-benchmark.md), and the operators' verbs bring rich and httpx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rabbit_retry import cli

TOPOLOGY = Path(__file__).resolve().parents[2] / "topologies" / "demo.yml"

# The worker verb's whole start path short of the broker: the verb's module, the runner and the
# topology are imported and the file loaded, then the consumer fails to import (exit 2).
START = f"""
import atexit, sys
atexit.register(lambda: print(sorted(
    m for m in ("rich", "httpx", "psycopg", "redis", "rabbit_retry.cli.operate",
                "rabbit_retry.cli.provision", "rabbit_retry.worker.runner") if m in sys.modules)))
from rabbit_retry.cli import main
main(["--url", "amqp://localhost:1/", "worker", "no_such_module:X", "-t", {str(TOPOLOGY)!r}])
"""


def test_the_worker_verb_does_not_import_the_other_verbs() -> None:
    done = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True)
    assert "no module named 'no_such_module'" in done.stderr, done.stderr
    # The runner was imported (the path ran that far), nothing of the other verbs was.
    assert done.stdout.strip() == "['rabbit_retry.worker.runner']", done.stdout


def test_every_verb_is_listed_with_its_module() -> None:
    cli._register()
    registered = {name: cmd.callback.__module__ for name, cmd in cli.cli.commands.items()
                  if cmd.callback}
    assert registered == {name: f"rabbit_retry.cli.{mod}" for name, mod in cli._VERBS.items()}
