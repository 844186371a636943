"""Where an event may go: the exchanges and queues a topology file declares (pure).

``Outbox.add`` refuses any other destination before it writes anything, so a typo is an error in
the application's request, not a dead event found by the relay hours later. A destination is an
exchange of the file (not an ``internal`` one: clients cannot publish to those), a built-in
``amq.*`` exchange the file binds a queue to, or a main queue of the file (published through the
default exchange with the queue's name as routing key).
"""

from __future__ import annotations

from dataclasses import dataclass

from rabbit_retry.topology.plan import Plan
from rabbit_retry.topology.resolved import Topology

MAX_SHORT_STRING = 255  # AMQP short strings: exchange names, routing keys, message ids


class UnknownDestination(ValueError):
    """``Outbox.add`` named an exchange or a queue the topology file does not declare (nothing
    was written)."""


@dataclass(frozen=True, slots=True)
class Destinations:
    exchanges: frozenset[str]
    queues: frozenset[str]
    source: str  # the topology file, for messages

    @classmethod
    def of(cls, topology: Topology) -> Destinations:
        from rabbit_retry.topology.compile import compile_topology

        return cls.of_plan(compile_topology(topology), topology.source)

    @classmethod
    def of_plan(cls, plan: Plan, source: str) -> Destinations:
        """The destinations of a compiled topology (what ``validate``, ``plan`` and ``export``
        hold)."""
        declared = {e.name for e in plan.exchanges if e.role == "user" and not e.internal}
        builtin = {b.source for b in plan.bindings if b.source.startswith("amq.")}
        return cls(frozenset(declared | builtin), frozenset(q.name for q in plan.main_queues),
                   source)

    @property
    def names(self) -> list[str]:
        """Every destination's name, as metrics label them (``destination_name``)."""
        return sorted(self.exchanges | self.queues)

    def describe(self) -> str:
        """One line: what ``Outbox.add`` takes for this file."""
        exchanges = ", ".join(sorted(self.exchanges)) or "none"
        queues = ", ".join(sorted(self.queues)) or "none"
        return f"outbox destinations: exchanges {exchanges}; queues {queues}"

    def resolve(self, exchange: str | None, routing_key: str | None,
                queue: str | None) -> tuple[str, str]:
        """The (exchange, routing key) an event is published with; ``UnknownDestination`` when
        the file does not declare it, ``ValueError`` when the arguments do not name one."""
        if queue is not None:
            if exchange:
                raise ValueError("give exchange= (with routing_key=) or queue=, not both")
            if routing_key not in (None, "", queue):
                raise ValueError(f"queue={queue!r}: an event to a queue takes no routing_key "
                                 "(the queue's name is its routing key)")
            return "", self.queue(queue)
        if exchange is None:
            raise ValueError("name a destination: exchange= (with routing_key=) or queue=")
        if not isinstance(exchange, str):
            raise TypeError(f"exchange: a str, got {type(exchange).__name__}")
        key = "" if routing_key is None else routing_key
        if not isinstance(key, str):
            raise TypeError(f"routing_key: a str, got {type(key).__name__}")
        if len(key.encode()) > MAX_SHORT_STRING:
            raise ValueError(f"routing_key: at most {MAX_SHORT_STRING} bytes")
        if exchange == "":  # the default exchange: the routing key names the queue
            return "", self.queue(key)
        if exchange not in self.exchanges:
            known = ", ".join(sorted(self.exchanges)) or "none"
            raise UnknownDestination(
                f"exchange {exchange!r} is not declared in {self.source} (its exchanges: "
                f"{known}); nothing was written")
        return exchange, key

    def queue(self, name: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"queue: a str, got {type(name).__name__}")
        if name not in self.queues:
            known = ", ".join(sorted(self.queues)) or "none"
            raise UnknownDestination(
                f"queue {name!r} is not a queue of {self.source} (its queues: {known}); "
                "nothing was written")
        return name


def destination_name(exchange: str, routing_key: str) -> str:
    """How metrics and the desk name where an event goes: its exchange, or the queue it was
    sent to straight (the default exchange)."""
    return exchange or routing_key
