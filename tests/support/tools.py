"""External programs a test needs: found on PATH, else the test fails in CI and skips locally."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    """The same reading of ``CI`` as scripts/test.sh: set and not ``0`` / ``false``."""
    return os.environ.get("CI", "") not in ("", "0", "false")


def require(program: str, *, installed_by: str) -> str:
    """The path of ``program``. Missing, it fails the test in CI (where scripts/test.sh
    installs it, so missing means the setup broke) and skips it elsewhere, saying how to get it.
    """
    path = shutil.which(program)
    if path is not None:
        return path
    reason = f"{program} is not installed ({installed_by}; scripts/test.sh does it)"
    if in_ci():
        pytest.fail(f"{reason}; CI=true, so this fails instead of skipping")
    pytest.skip(reason)
