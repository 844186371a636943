"""Where the replicas of a quorum queue are, and what is wrong with them; pure.

The management API reports, per quorum queue, its ``leader``, its ``members`` (the nodes that
hold a replica) and which of them are ``online`` (3.10, 4.0 and 4.3 alike; ``online`` is a
statistic, a few seconds old). ``replicas: N`` in the file becomes
``x-quorum-initial-group-size``, which the broker reads only when it creates the queue: it
refuses a redeclare with the argument changed (``inequivalent arg``), and never adds or removes
a member by itself. So a queue declared before ``replicas`` was set, or while nodes were
missing, keeps the members it got; ``rabbitmq-queues add_member`` (one queue) or
``rabbitmq-queues grow`` (every queue matching a pattern) adds the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rabbit_retry.text import plural

GROUP_SIZE = "x-quorum-initial-group-size"


def wanted_replicas(asked: int | None, nodes: Sequence[str]) -> int | None:
    """How many replicas the file's ``asked`` can mean on a cluster of ``nodes``: the broker
    gives a new queue at most one per node. None when the file does not ask."""
    if asked is None:
        return None
    return min(asked, len(nodes)) if nodes else asked


@dataclass(frozen=True)
class Replication:
    """The replicas of one live quorum queue, against what the file asks for."""

    queue: str
    leader: str | None
    members: tuple[str, ...]
    online: tuple[str, ...]
    asked: int | None = None  # the file's replicas (x-quorum-initial-group-size)
    nodes: tuple[str, ...] = ()  # every node of the cluster, running or not

    @property
    def offline(self) -> tuple[str, ...]:
        return tuple(m for m in self.members if m not in self.online)

    @property
    def wanted(self) -> int | None:
        return wanted_replicas(self.asked, self.nodes)

    @property
    def short(self) -> bool:
        """Fewer members than the file asks for (as far as the cluster can give)."""
        return self.wanted is not None and bool(self.members) and len(self.members) < self.wanted

    @property
    def warning(self) -> str | None:
        """One line when a replica is offline or missing; None when all is as it should be."""
        problems = []
        if self.members and self.offline:
            text = (
                f"{len(self.online)} of {len(self.members)} replicas online "
                f"({', '.join(self.offline)} down)"
            )
            if len(self.online) * 2 <= len(self.members):
                text += (
                    "; no majority: the queue takes and hands out nothing until a node is back"
                )
            problems.append(text)
        if self.short:
            assert self.asked is not None
            text = f"{plural(len(self.members), 'replica')}, the file asks for {self.asked}"
            if self.wanted != self.asked:
                text += f" (at most {self.wanted} on this cluster)"
            problems.append(text)
        if not problems:
            return None
        return f"{self.queue}: " + "; ".join(problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "leader": self.leader,
            "members": list(self.members),
            "online": list(self.online),
            "replicas_asked": self.asked,
            "warning": self.warning,
        }


def _shell_word(text: str) -> str:
    plain = text and all(c.isalnum() or c in "@._-/:" for c in text)
    return text if plain else "'" + text.replace("'", "'\\''") + "'"


def grow_advice(queue: str, vhost: str, members: Sequence[str], nodes: Sequence[str],
                wanted: int) -> str:
    """What to run to give ``queue`` the replicas it lacks (apply does not change members)."""
    missing = [n for n in nodes if n not in members][: max(0, wanted - len(members))]
    where = f"--vhost {_shell_word(vhost)} " if vhost else ""
    if missing:
        adds = "; ".join(
            f"rabbitmq-queues add_member {where}{_shell_word(queue)} {node}" for node in missing
        )
    else:
        adds = f"rabbitmq-queues add_member {where}{_shell_word(queue)} NODE"
    return (
        f"add what is missing with {adds} (or rabbitmq-queues grow NODE all for every queue "
        "short of a replica on NODE); or leave it: apply does not change a live queue's "
        "replicas"
    )


def replicas_note(
    queue: str,
    vhost: str,
    asked: int | None,
    live_argument: Any,
    live: Replication,
) -> tuple[bool, str] | None:
    """For ``plan``: (short of replicas?, what to tell) about a live quorum queue whose
    ``x-quorum-initial-group-size`` or membership differs from the file; None when neither
    does. A changed argument alone is no conflict: apply never redeclares the queue, and the
    broker would refuse to."""
    argument_differs = live_argument != asked
    members = live.members
    if live.short:
        wanted = live.wanted
        assert wanted is not None
        have = f"{plural(len(members), 'replica')} ({', '.join(members)})"
        advice = grow_advice(queue, vhost, members, live.nodes, wanted)
        return True, f"{have}, the file asks for {asked}: {advice}"
    if not argument_differs:
        return None
    shown_live = "absent" if live_argument is None else str(live_argument)
    shown_file = "absent" if asked is None else str(asked)
    text = (
        f"{GROUP_SIZE}: live {shown_live}, file {shown_file}; the broker reads it only when it "
        "creates a queue and refuses to redeclare it changed, and apply leaves the queue as it "
        "is"
    )
    if members:
        text += f"; it has {plural(len(members), 'replica')} ({', '.join(members)})"
        wanted = live.wanted
        if wanted is not None and len(members) > wanted:
            text += (
                ", more than asked: leave it, or remove some with rabbitmq-queues "
                "delete_member"
            )
        elif wanted is not None:
            text += ", as asked: nothing to do"
    return False, text
