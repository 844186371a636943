"""The plan: the exact broker objects a topology needs, as plain values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["main", "tier", "parking", "retry-exchange", "user", "lanes-exchange", "lane",
               "held"]
DestinationType = Literal["queue", "exchange"]


def _args_key(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, default=str)


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: Mapping[str, Any] = field(default_factory=dict)
    role: Role = "user"
    owner: str | None = None  # the main queue a derived exchange belongs to


@dataclass(frozen=True)
class Queue:
    name: str
    role: Role
    owner: str  # the main queue this object serves (itself for a main queue)
    arguments: Mapping[str, Any] = field(default_factory=dict)
    durable: bool = True
    delay_ms: int | None = None  # tiers only

    @property
    def queue_type(self) -> str:
        return str(self.arguments.get("x-queue-type", "classic"))


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    routing_key: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    destination_type: DestinationType = "queue"  # an exchange: an ordered queue's lanes exchange

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """Identity as the broker sees it: two bindings with equal keys are the same binding."""
        return (self.source, self.destination, self.routing_key, _args_key(self.arguments),
                self.destination_type)


@dataclass(frozen=True)
class Policy:
    """A policy rabbit-retry manages: one queue's tunables, matched by its exact name."""

    name: str
    pattern: str
    definition: Mapping[str, Any]
    priority: int
    queue: str
    apply_to: str = "queues"


@dataclass(frozen=True)
class Plan:
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    policies: tuple[Policy, ...] = ()
    # (old name, main queue of the file): ``renamed_from``, whose messages ``migrate`` moves.
    renames: tuple[tuple[str, str], ...] = ()

    def queues_of(self, owner: str) -> tuple[Queue, ...]:
        return tuple(q for q in self.queues if q.owner == owner)

    @property
    def main_queues(self) -> tuple[Queue, ...]:
        return tuple(q for q in self.queues if q.role == "main")
