"""Which queues of a topology live on one node of a cluster; pure.

On a cluster a classic queue lives on the node that declared it (RabbitMQ 4.x has no classic
mirroring; 3.x mirrors one only under an ``ha-mode`` policy), and a quorum queue with one
member is no safer. Their messages go with that node's disk. ``plan``, ``apply`` and
``status`` say so, one line per main queue, whenever the broker is a cluster of more than one
node (as far as the user may see: listing nodes needs the ``monitoring`` tag; without it there
is nothing to say).
"""

from __future__ import annotations

import re

from rabbit_retry.broker.inspect import LiveState
from rabbit_retry.text import plural
from rabbit_retry.topology.plan import Plan, Queue


def _mirrored(queue: Queue, live: LiveState) -> bool:
    """Whether a 3.x ``ha-mode`` policy mirrors the classic ``queue`` (the one of highest
    priority among the matching policies decides, as on the broker)."""
    matching = []
    for policy in live.policies:
        if policy.operator or policy.apply_to not in ("queues", "all", "classic_queues"):
            continue
        try:
            if re.search(policy.pattern, queue.name) is not None:
                matching.append(policy)
        except re.error:  # a pattern only Erlang's regex engine reads: not ours to guess
            continue
    if not matching:
        return False
    return "ha-mode" in max(matching, key=lambda p: p.priority).definition


def _one_node(queue: Queue, live: LiveState) -> bool:
    live_queue = live.queues.get(queue.name)
    queue_type = live_queue.type if live_queue is not None else queue.queue_type
    if queue_type == "classic":
        return not _mirrored(queue, live)
    if queue_type != "quorum":
        return False
    if live_queue is not None and live_queue.members:
        return len(live_queue.members) == 1
    return queue.arguments.get("x-quorum-initial-group-size") == 1


def single_node_notes(plan: Plan, live: LiveState) -> list[str]:
    """One line per main queue some of whose queues (itself, its tiers, its parking queue...)
    live on one node of a multi-node cluster; empty on one node or when nodes are not known."""
    if len(live.nodes) < 2:
        return []
    notes = []
    for main in plan.main_queues:
        alone = [q.name for q in plan.queues_of(main.name) if _one_node(q, live)]
        if not alone:
            continue
        shown = ", ".join(alone[:4]) + (f" and {len(alone) - 4} more" if len(alone) > 4 else "")
        notes.append(
            f"{plural(len(alone), 'queue')} of {main.name} ({shown}) "
            f"{'lives' if len(alone) == 1 else 'live'} on one node of this "
            f"{len(live.nodes)}-node cluster: messages there are lost with that node's disk; "
            "queue_type: quorum keeps them on several"
        )
    return notes
