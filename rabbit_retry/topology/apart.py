"""``load_topology`` run in a short-lived child process, so the caller never imports the YAML
reader and the pydantic schema that check the file.

A worker holds its topology for as long as it runs, and an idle worker's memory is mostly what
it imported: reading the file with ruamel.yaml and validating it with pydantic (about 11 MB of
a worker's resident memory, docs/worker-benchmark.md) is done in a fork that sends back the
resolved ``Topology`` (plain dataclasses, ``resolved``) or the file's problems, and exits.

Where a fork is not safe or not possible (no ``os.fork``, other threads running, the caller has
already imported pydantic anyway), and whenever the child fails for any other reason than the
file's problems, the file is loaded in this process instead: the outcome is the same, only the
memory differs.
"""

from __future__ import annotations

import marshal
import os
import sys
import threading
from pathlib import Path
from typing import Any

from rabbit_retry.topology.resolved import Topology, from_values, to_values


def load_topology_apart(path: str | Path) -> Topology:
    """``load_topology(path)``, its parsing done in a child process where that is safe."""
    if not _can_fork():
        return _load_here(path)
    answer = _in_child(path)
    if answer is not None:
        kind, value = answer
        if kind == "topology":
            return from_values(value)
        if kind == "problems" and isinstance(value, list):
            from rabbit_retry.topology.load import TopologyError

            raise TopologyError([str(line) for line in value])
    # The child failed otherwise (a bug, a signal, a value marshal cannot carry): raise
    # whatever that is here, with its traceback, or succeed if it was the child's alone.
    return _load_here(path)


def _can_fork() -> bool:
    return (
        hasattr(os, "fork")
        and threading.active_count() == 1  # a fork copies no other thread, but their locks
        and "pydantic" not in sys.modules  # already paid for: nothing to save
    )


def _load_here(path: str | Path) -> Topology:
    from rabbit_retry.topology.load import load_topology

    return load_topology(path)


def _in_child(path: str | Path) -> tuple[str, Any] | None:
    """("topology", ``to_values(Topology)``) or ("problems", [line, ...]) from a forked child;
    None when the child said nothing usable. ``marshal`` carries them: it is built into the
    interpreter, so the parent imports nothing to read them. A value it cannot carry (a YAML
    date in a queue's arguments, say) makes the child say nothing: the parent loads the file
    itself."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read_end)
            answer: tuple[str, Any]
            from rabbit_retry.topology.load import TopologyError, load_topology

            try:
                answer = ("topology", to_values(load_topology(path)))
            except TopologyError as exc:
                answer = ("problems", exc.lines)
            data = marshal.dumps(answer)
            with os.fdopen(write_end, "wb") as out:
                out.write(data)
            code = 0
        finally:
            # No atexit handlers, no flushing of the parent's buffered output twice.
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    try:
        answer = marshal.loads(data)
    except Exception:  # the child wrote nothing (it failed) or was cut short
        return None
    return answer if isinstance(answer, tuple) and len(answer) == 2 else None
