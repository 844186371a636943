"""Declaring a topology for a test or a benchmark through the product's own declare code
(``rabbit_retry.broker.declare``), as ``rabbit-retry apply`` does on an empty vhost (test-only).

Nothing is read from the management API first: every object is declared, which is idempotent
for objects that already exist as planned.
"""

from __future__ import annotations

import asyncio

from rabbit_retry.broker.declare import apply_changes
from rabbit_retry.broker.diff import diff
from rabbit_retry.broker.inspect import LiveState
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Plan, Topology, compile_topology, parse_topology


def topology(text: str, source: str = "worker-test.yml") -> Topology:
    """``text`` parsed as a topology file named ``source`` (errors name the file)."""
    return parse_topology(text, source)


async def provision(settings: Settings, what: Topology | str) -> Plan:
    """Declares every exchange, queue and binding ``what`` (a topology, or its YAML text)
    compiles to; returns the plan."""
    topo = topology(what) if isinstance(what, str) else what
    plan = compile_topology(topo)
    await apply_changes(settings, diff(plan, LiveState.empty()))
    return plan


def provision_sync(settings: Settings, what: Topology | str) -> Plan:
    """``provision`` from synchronous code."""
    return asyncio.run(provision(settings, what))
