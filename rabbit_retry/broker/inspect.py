"""Live broker state of one vhost, read through the management API, as plain values.

The diff compares these values with the plan; nothing here decides anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

from rabbit_retry.broker.management import Management, NotFound
from rabbit_retry.errors import BrokerError
from rabbit_retry.topology.plan import Binding


@dataclass(frozen=True)
class LiveQueue:
    name: str
    type: str  # 'classic' | 'quorum' | 'stream'
    durable: bool
    auto_delete: bool
    arguments: Mapping[str, Any]
    # Counts come from the management statistics, which lag by a few seconds: good enough to
    # report, never to decide a delete (declare.py deletes with broker-side checks); `status`
    # puts exact ready and consumer counts in their place (with_exact_counts).
    messages: int = 0
    messages_ready: int = 0
    messages_unacknowledged: int = 0
    consumers: int = 0
    # Quorum queues only: messages the queue holds until their dead-letter target confirms.
    messages_dlx: int = 0
    message_bytes_ready: int = 0  # bodies of the ready messages: what max-length-bytes counts
    # Quorum queues only (broker/replicas.py): the node leading it, the nodes holding a
    # replica, and those of them the API saw running at its last statistics collection.
    leader: str | None = None
    members: tuple[str, ...] = ()
    online: tuple[str, ...] = ()


@dataclass(frozen=True)
class LiveExchange:
    name: str
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LivePolicy:
    name: str
    pattern: str
    apply_to: str  # queues | exchanges | all | classic_queues | quorum_queues | streams
    definition: Mapping[str, Any]
    priority: int
    operator: bool = False  # an operator policy: merged with the queue's, lower limits win


@dataclass(frozen=True)
class LiveState:
    queues: Mapping[str, LiveQueue]
    exchanges: Mapping[str, LiveExchange]  # the default exchange ("") is left out
    bindings: tuple[Binding, ...]  # queue-destination bindings from non-default exchanges
    nodes: tuple[str, ...] = ()  # every node of the cluster, running or not
    vhost: str = ""
    policies: tuple[LivePolicy, ...] = ()  # policies and operator policies of the vhost
    version: str = ""  # RabbitMQ's, e.g. "4.3.6" ("": not read)

    @classmethod
    def empty(cls) -> LiveState:
        return cls(queues={}, exchanges={}, bindings=())


@dataclass(frozen=True)
class NodeCapacity:
    """What limits how many quorum queues the broker can hold (see diff.capacity_problem)."""

    version: str  # RabbitMQ version, e.g. "3.10.8"
    fd_total: int | None  # the smallest open-file limit of the cluster's nodes
    quorum_queues: int  # quorum queues on the broker, every vhost
    readable: bool = True  # False: the user may not read the nodes (no monitoring tag)


def _count(raw: Mapping[str, Any], key: str) -> int:
    # Fresh quorum queues report no statistics until the first emission: absent means zero.
    value = raw.get(key)
    return int(value) if isinstance(value, int | float) else 0


def _names(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def parse_queue(raw: Mapping[str, Any]) -> LiveQueue:
    arguments = dict(raw.get("arguments") or {})
    leader = raw.get("leader")
    return LiveQueue(
        name=str(raw["name"]),
        type=str(raw.get("type") or arguments.get("x-queue-type") or "classic"),
        durable=bool(raw.get("durable", False)),
        auto_delete=bool(raw.get("auto_delete", False)),
        arguments=arguments,
        messages=_count(raw, "messages"),
        messages_ready=_count(raw, "messages_ready"),
        messages_unacknowledged=_count(raw, "messages_unacknowledged"),
        consumers=_count(raw, "consumers"),
        messages_dlx=_count(raw, "messages_dlx"),
        message_bytes_ready=_count(raw, "message_bytes_ready"),
        leader=str(leader) if isinstance(leader, str) and leader else None,
        members=_names(raw, "members"),
        online=_names(raw, "online"),
    )


def parse_exchange(raw: Mapping[str, Any]) -> LiveExchange:
    return LiveExchange(
        name=str(raw["name"]),
        type=str(raw["type"]),
        durable=bool(raw.get("durable", False)),
        auto_delete=bool(raw.get("auto_delete", False)),
        internal=bool(raw.get("internal", False)),
        arguments=dict(raw.get("arguments") or {}),
    )


def parse_bindings(raw: Iterable[Mapping[str, Any]]) -> tuple[Binding, ...]:
    return tuple(
        Binding(
            str(b["source"]),
            str(b["destination"]),
            str(b.get("routing_key", "")),
            dict(b.get("arguments") or {}),
            "exchange" if b.get("destination_type") == "exchange" else "queue",
        )
        for b in raw
        if b.get("source") and b.get("destination_type") in ("queue", "exchange")
    )


def parse_policies(raw: Iterable[Mapping[str, Any]], *, operator: bool) -> tuple[LivePolicy, ...]:
    return tuple(
        LivePolicy(
            name=str(p["name"]),
            pattern=str(p.get("pattern", "")),
            apply_to=str(p.get("apply-to", "all")),
            definition=dict(p.get("definition") or {}),
            priority=int(p.get("priority") or 0),
            operator=operator,
        )
        for p in raw
    )


_QUEUE_COLUMNS = ",".join(
    ("name", "type", "durable", "auto_delete", "arguments", "messages", "messages_ready",
     "messages_unacknowledged", "consumers", "messages_dlx", "message_bytes_ready", "leader",
     "members", "online")
)
_EXCHANGE_COLUMNS = "name,type,durable,auto_delete,internal,arguments"


def read_live(api: Management, vhost: str) -> LiveState:
    """Every queue, exchange and queue binding of ``vhost``; ``BrokerError`` if it is missing."""
    api.require_vhost(vhost)
    where = quote(vhost, safe="")
    try:
        # Only the fields the diff reads: a queue's full statistics are most of the payload,
        # and on a big vhost the management API's answer is most of a no-op apply's time.
        raw_queues = api.get(f"/queues/{where}", columns=_QUEUE_COLUMNS)
        raw_exchanges = api.get(f"/exchanges/{where}", columns=_EXCHANGE_COLUMNS)
        raw_bindings = api.bindings(vhost)
        policies = parse_policies(api.get(f"/policies/{where}"), operator=False)
        policies += parse_policies(api.get(f"/operator-policies/{where}"), operator=True)
    except NotFound:  # deleted while we read
        raise BrokerError(f"vhost {vhost!r} does not exist on the broker") from None
    queues = {q.name: q for q in map(parse_queue, raw_queues)}
    exchanges = {e.name: e for e in map(parse_exchange, raw_exchanges) if e.name}
    overview = api.overview()
    return LiveState(queues=queues, exchanges=exchanges, bindings=parse_bindings(raw_bindings),
                     nodes=_cluster_nodes(api), vhost=vhost, policies=policies,
                     version=str(overview.get("rabbitmq_version") or ""))


def _cluster_nodes(api: Management) -> tuple[str, ...]:
    """The names of the cluster's nodes, or none when the user may not list them (only the
    monitoring and administrator tags may): replica checks then go without the cluster's size.
    """
    if not api.may("monitoring"):
        return ()
    try:
        raw = api.get("/nodes", columns="name")
    except (BrokerError, NotFound):
        return ()
    return tuple(sorted(str(n["name"]) for n in raw if isinstance(n, dict) and n.get("name")))



def read_capacity(api: Management) -> NodeCapacity:
    """The broker's version and, for a user tagged monitoring or administrator, its nodes'
    open-file limit and every vhost's quorum queues; for another user ``fd_total`` is None (its
    ``GET /api/nodes`` is refused, and it would see only its own vhosts' queues)."""
    overview = api.overview()
    version = str(overview.get("rabbitmq_version") or overview.get("management_version") or "")
    if not api.may("monitoring"):
        return NodeCapacity(version=version, fd_total=None, quorum_queues=0, readable=False)
    limits = [n["fd_total"] for n in api.get("/nodes") if isinstance(n.get("fd_total"), int)]
    queues = api.get("/queues", columns="type")
    return NodeCapacity(
        version=version,
        fd_total=min(limits) if limits else None,
        quorum_queues=sum(1 for q in queues if q.get("type") == "quorum"),
    )


def with_exact_counts(live: LiveState, counts: Mapping[str, tuple[int, int]]) -> LiveState:
    """``live`` with the ready and consumer counts of ``counts`` (queue -> (ready, consumers),
    read from the broker this moment) in place of the management API's samples. Unacked counts
    stay sampled: only the statistics know them."""
    queues = dict(live.queues)
    for name, (ready, consumers) in counts.items():
        queue = queues.get(name)
        if queue is not None:
            queues[name] = replace(
                queue,
                messages=ready + queue.messages_unacknowledged,
                messages_ready=ready,
                consumers=consumers,
            )
    return replace(live, queues=queues)
