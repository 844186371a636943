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
- The parking queue is classic unless the file asks for quorum. A classic queue has no delivery
  limit and a requeued message keeps its place, so peeks never lose or reorder anything; but on
  a cluster it lives on one node. A quorum parking queue is replicated, and carries a delivery
  limit no peek will ever reach: without one, 4.x drops a message after 20 returns (a peek is a
  return on 3.10-4.2), and 3.10 reads -1 as "drop at the first return", so -1 cannot serve every
  version. It has no dead-letter target: nothing ever leaves it but by a verb or the desk.
- ``replicas`` sets ``x-quorum-initial-group-size`` on every quorum queue of ``Q``.
"""

from __future__ import annotations

from typing import Any

from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Exchange, Plan, Policy, Queue
from rabbit_retry.topology.resolved import QueueConfig, Topology

# Returns before a quorum parking queue drops a message: 2**31 - 1, accepted as a limit by 3.10,
# 4.0 and 4.3 (each checked to keep 100 messages requeued 25 times).
PARKING_DELIVERY_LIMIT = 2_147_483_647


def _type_arguments(queue_type: str, replicas: int | None) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-queue-type": queue_type}
    if queue_type == "quorum":
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"
        if replicas is not None:
            arguments["x-quorum-initial-group-size"] = replicas
    return arguments


def parking_arguments(queue: QueueConfig) -> dict[str, Any]:
    if queue.parking_type == "classic":
        return {"x-queue-type": "classic"}
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-delivery-limit": PARKING_DELIVERY_LIMIT,
    }
    if queue.replicas is not None:
        arguments["x-quorum-initial-group-size"] = queue.replicas
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
            **_type_arguments(queue.queue_type, queue.replicas),
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
                    **_type_arguments(queue.queue_type, queue.replicas),
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
            arguments=parking_arguments(queue),
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
