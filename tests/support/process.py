"""The ``rabbit-retry`` command as separate processes (test-only, shared with bench/)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rabbit_retry.settings import Settings

# The console script of the interpreter running the tests (the venv's).
CLI = str(Path(sys.executable).with_name("rabbit-retry"))


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def cli(settings: Settings | None, *args: str, timeout: float = 120.0, cwd: Path | None = None,
        env: Mapping[str, str] | None = None) -> Ran:
    """``rabbit-retry [--url U --management-url M] ARGS`` as a separate process."""
    argv = [CLI]
    if settings is not None:
        argv += ["--url", settings.url_list, "--management-url", settings.management_url_list]
    argv += list(args)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        cwd=cwd, env={**os.environ, **(env or {})},
    )
    return Ran(done.returncode, done.stdout, done.stderr)


def apply(settings: Settings, topology: Path) -> None:
    """``rabbit-retry apply TOPOLOGY``, which must succeed."""
    result = cli(settings, "apply", str(topology))
    assert result.code == 0, result.err


def stop(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not exited after ``grace`` seconds."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
