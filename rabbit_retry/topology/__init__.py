"""The topology: a YAML file, its schema, and the plan of broker objects it compiles to.

The names below are imported on first use: a worker holds a resolved ``Topology`` and reads
``naming`` without loading the YAML reader and the pydantic schema (``load_apart``).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rabbit_retry.topology.compile import compile_topology
    from rabbit_retry.topology.load import TopologyError, load_topology, parse_topology
    from rabbit_retry.topology.plan import Binding, Exchange, Plan, Queue
    from rabbit_retry.topology.resolved import QueueConfig, RetryPolicy, Topology

_HOMES = {
    "Binding": "plan",
    "Exchange": "plan",
    "Plan": "plan",
    "Queue": "plan",
    "QueueConfig": "resolved",
    "RetryPolicy": "resolved",
    "Topology": "resolved",
    "TopologyError": "load",
    "compile_topology": "compile",
    "load_topology": "load",
    "parse_topology": "load",
}

__all__ = [
    "Binding",
    "Exchange",
    "Plan",
    "Queue",
    "QueueConfig",
    "RetryPolicy",
    "Topology",
    "TopologyError",
    "compile_topology",
    "load_topology",
    "parse_topology",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rabbit_retry.topology' has no attribute {name!r}")
    return getattr(import_module(f"rabbit_retry.topology.{home}"), name)
