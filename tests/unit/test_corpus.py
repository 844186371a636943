"""Every file in corpus/bad/ fails to load with one exact, located line; corpus/good/ loads.

The layout and ``expected.yml`` are described in corpus/README.md; the CLI tests reuse them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from rabbit_retry.errors import EXIT_INPUT
from rabbit_retry.topology import compile_topology, load_topology
from rabbit_retry.topology.load import TopologyError

CORPUS = Path(__file__).parent / "corpus"
BAD = sorted((CORPUS / "bad").iterdir())
GOOD = sorted((CORPUS / "good").iterdir())


def expected() -> dict[str, dict[str, Any]]:
    loaded: dict[str, dict[str, Any]] = YAML(typ="safe").load(CORPUS / "expected.yml")
    return loaded


def test_the_corpus_is_complete() -> None:
    assert len(BAD) >= 30 and len(GOOD) >= 10
    assert sorted(expected()) == [path.name for path in BAD]
    assert all(path.suffix == ".yml" for path in BAD + GOOD)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_file_fails_with_one_located_line(path: Path) -> None:
    want = expected()[path.name]
    with pytest.raises(TopologyError) as excinfo:
        load_topology(path)
    error = excinfo.value
    assert error.exit_code == EXIT_INPUT == 2
    [line] = error.lines  # each file holds exactly one mistake
    assert str(error) == line
    prefix = f"{path}:{want['line']}: "
    assert line.startswith(prefix)
    if "key" in want:
        assert line.startswith(f"{prefix}{want['key']}: ")
    assert want["fragment"] in line
    assert "Traceback" not in line and "\n" not in line and "\r" not in line
    assert len(line) < 400


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_file_loads_and_compiles(path: Path) -> None:
    topology = load_topology(path)
    plan = compile_topology(topology)
    assert topology.queues
    for queue in topology.queues:
        names = {q.name for q in plan.queues_of(queue.name)}
        assert {queue.name, f"{queue.name}.parking"} <= names
        assert len(names) == 2 + len(queue.retry.tiers_ms)
