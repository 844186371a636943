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
- Broker dead letters of ``Q`` (routing key ``Q``) go to the first tier, or, when the file parks
  what overflows or expires (``on_full`` / ``on_expire``: park), to ``Q.parking``, or nowhere
  (``drop``): never to a tier, from which they would come back in a cycle the broker breaks by
  dropping them (topology/limits.py). A parked-by-the-broker message says why in its
  ``x-death`` (``contract.parked_reason``).
- ``replicas`` sets ``x-quorum-initial-group-size`` on every quorum queue of ``Q``.
- An ordered queue (``ordered``) is entered through ``Q.lanes``, a consistent-hash exchange
  (RabbitMQ's ``rabbitmq_consistent_hash_exchange`` plugin, on every version: 4.3's built-in
  ``x-modulus-hash`` hashes the routing key only, so a header key would need the plugin anyway,
  and one type keeps one plan for every broker). The file's bindings bind ``Q.lanes`` to their
  exchanges, so a key's messages always reach the same lane queue ``Q.lane.<i>``, which takes
  the main queue's arguments and a single active consumer: one worker at a time takes a lane,
  in order, and the next one takes over when it goes. ``Q`` itself only takes messages coming
  back (from a tier, a replay): the worker sends each on to ``Q.lanes``. Each lane has a held
  queue ``Q.lane.<i>.held`` with the parking queue's arguments (nothing in it expires or is
  dropped) for the messages of keys that wait for an earlier one.
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
    return _keeping_arguments(queue.parking_type, queue.replicas)


def _keeping_arguments(queue_type: str, replicas: int | None) -> dict[str, Any]:
    """A queue that keeps what it holds until a worker or an operator takes it: no TTL, no
    dead-letter target, and on quorum a delivery limit no peek or takeover reaches."""
    if queue_type == "classic":
        return {"x-queue-type": "classic"}
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-delivery-limit": PARKING_DELIVERY_LIMIT,
    }
    if replicas is not None:
        arguments["x-quorum-initial-group-size"] = replicas
    return arguments


LANES_EXCHANGE_TYPE = "x-consistent-hash"
LANES_PLUGIN = "rabbitmq_consistent_hash_exchange"
# The argument ``apply`` declares a lanes exchange with on RabbitMQ 4.3 and later, where its ring
# stays in the order the lanes were bound (in lane order, ``broker/declare.py``) through node
# restarts: taking the last lanes away then moves only their keys. Not in the plan (an exchange
# declared before it, or on an older version, stays as it is): the diff ignores it.
RING_IN_LANE_ORDER = ("rabbit-retry-ring", "lane order")


def held_arguments(queue: QueueConfig) -> dict[str, Any]:
    """A held queue keeps what it holds as a parking queue does, in the main queue's type."""
    return _keeping_arguments(queue.queue_type, queue.replicas)


def _lanes(
    queue: QueueConfig, main_arguments: dict[str, Any]
) -> tuple[list[Exchange], list[Queue], list[Binding]]:
    """An ordered queue's lanes exchange, lane and held queues, and their bindings."""
    assert queue.ordered is not None
    name, ordered = queue.name, queue.ordered
    lanes = naming.lanes_exchange(name)
    hashing = {} if ordered.header is None else {"hash-header": ordered.header}
    exchanges = [Exchange(lanes, LANES_EXCHANGE_TYPE, arguments=hashing, role="lanes-exchange",
                          owner=name)]
    queues: list[Queue] = []
    # The file's bindings bind the lanes exchange; the binding key of a lane is its weight.
    bindings = [Binding(b.exchange, lanes, b.routing_key, dict(b.arguments), "exchange")
                for b in queue.bindings]
    for lane in range(ordered.lanes):
        lane_name = naming.lane_queue(name, lane)
        queues.append(Queue(lane_name, "lane", name,
                            {**main_arguments, "x-single-active-consumer": True}))
        queues.append(Queue(naming.held_queue(name, lane), "held", name, held_arguments(queue)))
        bindings.append(Binding(lanes, lane_name, "1"))
    return exchanges, queues, bindings


def missing_plugin(plan: Plan, exchange_types: set[str]) -> str | None:
    """The one line ``apply`` says when the broker lacks the exchange type an ordered queue's
    lanes need (``exchange_types``: what the broker offers), or None."""
    ordered = [e.owner for e in plan.exchanges if e.type == LANES_EXCHANGE_TYPE and e.owner]
    if not ordered or LANES_EXCHANGE_TYPE in exchange_types:
        return None
    return (f"queue {ordered[0]!r} is ordered: enable RabbitMQ's consistent-hash exchange on "
            f"every node first: rabbitmq-plugins enable {LANES_PLUGIN}")


def compile_queue(queue: QueueConfig) -> tuple[list[Exchange], list[Queue], list[Binding]]:
    """Every object that one main queue needs, in the order they should be declared."""
    name = queue.name
    retry_exchange = naming.retry_exchange(name)
    main_arguments = {
        **queue.arguments,
        **_type_arguments(queue.queue_type, queue.replicas),
        "x-dead-letter-exchange": retry_exchange,
        "x-dead-letter-routing-key": name,
    }
    main = Queue(name=name, role="main", owner=name, arguments=main_arguments)
    exchanges = [Exchange(retry_exchange, "direct", role="retry-exchange", owner=name)]
    queues = [main]
    if queue.ordered is not None:
        lane_exchanges, lane_queues, bindings = _lanes(queue, main_arguments)
        exchanges += lane_exchanges
        queues += lane_queues
    else:
        bindings = [Binding(b.exchange, name, b.routing_key, dict(b.arguments))
                    for b in queue.bindings]
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
        if index == 0 and name != routing_key and queue.dead_letter_route == "tier":
            # Broker dead letters from Q carry routing key Q: they land in the first tier.
            bindings.append(Binding(retry_exchange, tier, name))
    parking = naming.parking_queue(name)
    queues.append(Queue(name=parking, role="parking", owner=name,
                        arguments=parking_arguments(queue)))
    if queue.dead_letter_route == "parking":
        # Overflowed and expired messages (topology/limits.py), and a delivery limit's.
        bindings.append(Binding(retry_exchange, parking, name))
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
    renames = tuple((q.renamed_from, q.name) for q in topology.queues if q.renamed_from)
    return Plan(tuple(exchanges), tuple(queues), tuple(bindings), policies, renames)
