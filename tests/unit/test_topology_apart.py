"""A topology checked in a child process (topology/apart.py) is the one ``load_topology`` gives,
its problems read the same, and what the child cannot send is loaded in the parent instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rabbit_retry.topology import load_topology
from rabbit_retry.topology.resolved import from_values, to_values

TOPOLOGIES = sorted((Path(__file__).resolve().parents[2] / "topologies").glob("*.yml"))

# In a fresh interpreter, so that pydantic is not loaded yet and the fork is taken; prints
# whether the parent loaded pydantic (only a fallback does) and the topology's repr.
APART = """
import sys
from rabbit_retry.topology.apart import load_topology_apart
topology = load_topology_apart(sys.argv[1])
print("pydantic" in sys.modules)
print(repr(topology))
"""


def _apart(path: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", APART, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_the_child_sends_back_the_same_topology(path: Path) -> None:
    imported_pydantic, shown = _apart(path)
    assert imported_pydantic == "False"
    assert shown == repr(load_topology(path))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_plain_values_round_trip(path: Path) -> None:
    topology = load_topology(path)
    assert from_values(to_values(topology)) == topology


def test_a_child_that_fails_leaves_the_file_to_the_parent() -> None:
    # The child cannot send its answer (here its conversion fails): the parent loads the file.
    broken = APART.replace(
        "topology = ",
        "import rabbit_retry.topology.apart as apart\n"
        "def broken(topology): raise ValueError('cannot send')\n"
        "apart.to_values = broken\n"
        "topology = ",
    )
    done = subprocess.run([sys.executable, "-c", broken, str(TOPOLOGIES[0])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True", repr(load_topology(TOPOLOGIES[0]))]
