"""The README's first command, ``scripts/quickstart.sh``, as CI runs it (no terminal), against
a vhost of its own: the whole loop ends with the desk showing what parked, and stops by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from rabbit_retry.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _venv_over_the_suites(tmp_path: Path) -> Path:
    """A venv of its own that sees the suite's packages (a ``.pth`` naming them): the script's
    ``pip install -e`` then installs rabbit-retry into it alone, with nothing to download. Run
    in the suite's venv, it reinstalled rabbit-retry there, and a test beside it that started
    the command at that moment failed: "can't open file '.venv/bin/rabbit-retry'"."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [site] = (venv / "lib").glob("python3*/site-packages")
    (site / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_quickstart_shows_the_whole_loop_and_ends_by_itself(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    env = {**os.environ, "CI": "true", "VENV": str(_venv_over_the_suites(tmp_path)),
           "RABBIT_RETRY_URL": fresh_vhost.url,
           "RABBIT_RETRY_MANAGEMENT_URL": fresh_vhost.management_url,
           "RABBIT_RETRY_DESK_STORE": f"sqlite:///{tmp_path / 'desk.db'}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "handled order-2 at attempt 2" in out  # the retry through the 1 s tier
    assert "rolled back order-4: card declined; no order, no event" in out
    assert "the relay published 3 events; 2 succeeded, 1 parked" in out
    assert ("1 x demo.orders: rabbit_retry.worker.consumer.Permanent: customer 'ghost' does not "
            "exist (permanent)") in out
    assert "The failure desk served http://127.0.0.1:" in out
    assert (tmp_path / "desk.db").exists()
