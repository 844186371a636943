"""The resolved topology (defaults merged into every queue) that the compiler and the worker
read: frozen dataclasses, free of pydantic.

``model.py`` validates a file with pydantic and ``model.resolve`` builds these. A worker only
reads them, so it can hold a topology without importing pydantic (docs/worker-benchmark.md,
"Idle memory"); the checks below are for values built by hand (tests, the API).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

QueueType = Literal["quorum", "classic"]
ExchangeType = Literal["direct", "topic", "fanout", "headers"]

# Parking stays classic unless the file asks: an existing classic parking queue is never turned
# into a conflict by an upgrade, and on one node a classic queue keeps a peeked message's place.
DEFAULT_PARKING_TYPE: QueueType = "classic"
DEFAULT_POLICY_PRIORITY = 10


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how late a queue's handler is tried again."""

    delays_ms: tuple[int, ...]
    max_attempts: int

    def __post_init__(self) -> None:
        if not self.delays_ms:
            raise ValueError("delays_ms: at least one delay")
        if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in self.delays_ms):
            raise ValueError(f"delays_ms: positive whole milliseconds, got {self.delays_ms!r}")
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"max_attempts: at least 1, got {attempts!r}")
        object.__setattr__(self, "delays_ms", tuple(self.delays_ms))

    @property
    def tiers_ms(self) -> tuple[int, ...]:
        """Distinct delays in the order they first appear: one tier queue each."""
        return tuple(dict.fromkeys(self.delays_ms))

    def delay_for(self, failures: int) -> int:
        """The delay before the next attempt, after ``failures`` failed ones (>= 1)."""
        return self.delays_ms[min(max(failures, 1), len(self.delays_ms)) - 1]


@dataclass(frozen=True, slots=True)
class BindingConfig:
    """One binding of a queue to an exchange, as the file wrote it."""

    exchange: str
    routing_key: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)


OnPark = Literal["hold", "continue"]
# What a main queue does with a message when it is full, or when a message's TTL runs out
# (README, "Length limits and TTLs"): refuse new publishes, park it, or drop it.
OnFull = Literal["reject", "park", "drop"]
OnExpire = Literal["park", "drop"]
# Where the main queue's own dead letters (routing key ``Q`` on ``Q.retry``) go: the first tier
# (a rejection by the worker's ``nack``), the parking queue, or nowhere (dropped).
DeadLetterRoute = Literal["tier", "parking", "drop"]


@dataclass(frozen=True, slots=True)
class OrderedConfig:
    """A queue's ordered keys (README, "Ordered keys"): messages of one key are handled in the
    order they were published; ``header`` names the header that carries the key (None: the
    routing key); ``lanes`` queues spread the keys over workers; ``on_park`` says whether a
    parked message holds its key."""

    header: str | None
    lanes: int
    on_park: OnPark = "hold"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    name: str
    queue_type: QueueType
    bindings: tuple[BindingConfig, ...]
    retry: RetryPolicy
    arguments: Mapping[str, Any]
    parking_type: QueueType = DEFAULT_PARKING_TYPE
    replicas: int | None = None  # x-quorum-initial-group-size of its quorum queues; None: broker's
    policy: Mapping[str, Any] = field(default_factory=dict)  # broker policy definition keys
    policy_priority: int = DEFAULT_POLICY_PRIORITY
    ordered: OrderedConfig | None = None
    on_full: OnFull | None = None
    on_expire: OnExpire | None = None
    renamed_from: str | None = None  # the queue's earlier name, whose messages migrate moves

    @property
    def dead_letter_route(self) -> DeadLetterRoute:
        """Where ``Q``'s broker dead letters go. An overflowed or expired message must never
        reach a tier: it would come back to ``Q`` by dead-lettering alone, a cycle the broker
        breaks by dropping it (``Dead-letter queues cycle detected``)."""
        choices = (self.on_full, self.on_expire)
        if "park" in choices:
            return "parking"
        if "drop" in choices:
            return "drop"
        return "tier"

    @property
    def quorum_queues(self) -> bool:
        """Whether any queue of ``Q`` (main, tiers, parking) is a quorum queue."""
        return "quorum" in (self.queue_type, self.parking_type)


@dataclass(frozen=True, slots=True)
class ExchangeConfig:
    name: str
    type: ExchangeType
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Topology:
    exchanges: tuple[ExchangeConfig, ...]
    queues: tuple[QueueConfig, ...]
    source: str = "<topology>"

    def queue(self, name: str) -> QueueConfig:
        for queue in self.queues:
            if queue.name == name:
                return queue
        raise KeyError(name)

    @property
    def queue_names(self) -> tuple[str, ...]:
        return tuple(q.name for q in self.queues)

    @property
    def on_park(self) -> dict[str, str]:
        """Each ordered queue's ``on_park``: ``hold`` or ``continue``."""
        return {q.name: q.ordered.on_park for q in self.queues if q.ordered is not None}


# --- as plain values: what crosses from the child process that checked the file (``apart``) ---


def to_values(topology: Topology) -> tuple[Any, ...]:
    """``topology`` as tuples, dicts and scalars only (what ``marshal`` can send)."""
    return (
        tuple(
            (e.name, e.type, e.durable, e.auto_delete, e.internal, dict(e.arguments))
            for e in topology.exchanges
        ),
        tuple(
            (
                q.name,
                q.queue_type,
                tuple((b.exchange, b.routing_key, dict(b.arguments)) for b in q.bindings),
                (q.retry.delays_ms, q.retry.max_attempts),
                dict(q.arguments),
                q.parking_type,
                q.replicas,
                dict(q.policy),
                q.policy_priority,
                None if q.ordered is None else (q.ordered.header, q.ordered.lanes,
                                                q.ordered.on_park),
                q.on_full,
                q.on_expire,
            )
            for q in topology.queues
        ),
        topology.source,
    )


def from_values(values: tuple[Any, ...]) -> Topology:
    """The ``Topology`` that ``to_values`` gave ``values`` for."""
    exchanges, queues, source = values
    return Topology(
        exchanges=tuple(ExchangeConfig(*e) for e in exchanges),
        queues=tuple(
            QueueConfig(
                name,
                queue_type,
                tuple(BindingConfig(*b) for b in bindings),
                RetryPolicy(*retry),
                arguments,
                parking_type,
                replicas,
                policy,
                priority,
                None if ordered is None else OrderedConfig(*ordered),
                on_full,
                on_expire,
            )
            for (name, queue_type, bindings, retry, arguments, parking_type, replicas, policy,
                 priority, ordered, on_full, on_expire) in queues
        ),
        source=source,
    )
