"""The topology: a YAML file, its schema, and the plan of broker objects it compiles to."""

from rabbit_retry.topology.compile import compile_topology
from rabbit_retry.topology.load import TopologyError, load_topology, parse_topology
from rabbit_retry.topology.model import QueueConfig, RetryPolicy, Topology
from rabbit_retry.topology.plan import Binding, Exchange, Plan, Queue

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
