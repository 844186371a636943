"""Topology -> Plan, as one pure function: the objects the README lists under "What one queue
`Q` compiles to".

Why the arguments are what they are:
- The main queue dead-letters to its own retry exchange with its own name as routing key, so a
  reject (or a quorum delivery limit) lands in the first tier, and its arguments never depend on
  the delays: changing delays adds tiers and never forces a delete-and-redeclare of ``Q``.
- Tiers dead-letter to the default exchange with routing key ``Q``, so a retried message returns
  to ``Q`` alone and is never fanned out again to siblings bound to the original exchange.
- Quorum queues (main and tiers) use at-least-once dead-lettering, which needs reject-publish
  overflow: the broker keeps a message until the next queue confirms it.
- The parking queue is a classic queue on every broker: classic queues have no delivery limit
  (RabbitMQ 4.x drops or dead-letters a quorum message after 20 deliveries by default), so
  peeking at parked messages any number of times can never lose one, and a requeued message
  keeps its place, so parked order survives a peek.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.topology import naming
from rabbit_retry.topology.model import QueueConfig, Topology
from rabbit_retry.topology.plan import Binding, Exchange, Plan, Policy, Queue


def _type_arguments(queue_type: str) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-queue-type": queue_type}
    if queue_type == "quorum":
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"
    return arguments


def compile_queue(queue: QueueConfig) -> tuple[list[Exchange], list[Queue], list[Binding]]:
    """Every object that one main queue needs, in the order they should be declared."""
    name = queue.name
    retry_exchange = naming.retry_exchange(name)
    main = Queue(
        name=name,
        role="main",
        owner=name,
        arguments={
            **queue.arguments,
            **_type_arguments(queue.queue_type),
            "x-dead-letter-exchange": retry_exchange,
            "x-dead-letter-routing-key": name,
        },
    )
    exchanges = [Exchange(retry_exchange, "direct", role="retry-exchange", owner=name)]
    queues = [main]
    bindings = [Binding(b.exchange, name, b.routing_key, dict(b.arguments)) for b in queue.bindings]
    for index, delay_ms in enumerate(queue.retry.tiers_ms):
        tier = naming.tier_queue(name, delay_ms)
        queues.append(
            Queue(
                name=tier,
                role="tier",
                owner=name,
                delay_ms=delay_ms,
                arguments={
                    **_type_arguments(queue.queue_type),
                    "x-message-ttl": delay_ms,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": name,
                },
            )
        )
        routing_key = naming.tier_routing_key(delay_ms)
        bindings.append(Binding(retry_exchange, tier, routing_key))
        if index == 0 and name != routing_key:
            # Broker dead letters from Q carry routing key Q: they land in the first tier.
            bindings.append(Binding(retry_exchange, tier, name))
    queues.append(
        Queue(
            name=naming.parking_queue(name),
            role="parking",
            owner=name,
            arguments={"x-queue-type": "classic"},
        )
    )
    return exchanges, queues, bindings


def compile_topology(topology: Topology) -> Plan:
    """Every broker object the topology needs. Exchanges: the file's, then one retry exchange
    per queue; queues: per main queue, itself, its tiers, its parking queue; bindings: per main
    queue, the file's, then the retry exchange's to the tiers."""
    exchanges = [
        Exchange(e.name, e.type, e.durable, e.auto_delete, e.internal, dict(e.arguments))
        for e in topology.exchanges
    ]
    queues: list[Queue] = []
    bindings: list[Binding] = []
    for queue in topology.queues:
        own_exchanges, own_queues, own_bindings = compile_queue(queue)
        exchanges += own_exchanges
        queues += own_queues
        bindings += own_bindings
    policies = tuple(
        Policy(
            name=naming.policy_name(q.name),
            pattern=naming.policy_pattern(q.name),
            definition=dict(q.policy),
            priority=q.policy_priority,
            queue=q.name,
        )
        for q in topology.queues
        if q.policy
    )
    return Plan(tuple(exchanges), tuple(queues), tuple(bindings), policies)
