"""Other policies that drop, expire or limit what the queues of a file hold; pure.

A policy applies to every queue whose name its pattern matches (and its ``apply-to`` takes):
a company-wide ``.*`` policy with ``message-ttl`` reaches parking queues and retry tiers as
surely as main queues. RabbitMQ applies the one matching policy of highest priority (of several
with that priority, one it picks: each is taken here as applying), then merges in the operator
policy of highest priority, the lower numeric value winning; a queue argument and a policy key
that set the same limit also give way to the lower (``x-dead-letter-exchange`` and
``x-overflow`` arguments win over a policy's). The keys of the file's own policy
(``rabbit-retry:Q``, from its ``policy:`` block) are what the file asked for, never a hazard.

Exchanges are matched too, but an exchange policy carries no key that drops, expires or limits
messages (``alternate-exchange``, federation): only queues are reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry.broker.inspect import LivePolicy, LiveState
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.durations import label
from rabbit_retry.topology.plan import Plan, Queue

# The keys looked at, in the order a queue's lines list them.
KEYS = ("message-ttl", "expires", "max-length", "max-length-bytes", "delivery-limit")
_ARGUMENT = {key: f"x-{key}" for key in KEYS}
_ROLE_NAMES = {
    "main": "main queue",
    "lane": "lane queue",
    "tier": "retry tier",
    "parking": "parking queue",
    "held": "held queue",
}
_SHOWN = 3  # queue names a line lists before "and N more"


@dataclass(frozen=True)
class PolicyHazard:
    """One key of one policy that drops, expires or limits the messages of one queue."""

    policy: LivePolicy
    key: str
    value: Any
    queue: str
    role: str  # main | lane | tier | parking | held
    owner: str  # the main queue of the file the queue belongs to
    effect: str  # what it does there, the same for every queue of the role

    @property
    def source(self) -> str:
        kind = "operator policy" if self.policy.operator else "policy"
        return (f"{kind} {self.policy.name} (pattern '{self.policy.pattern}', priority "
                f"{self.policy.priority})")

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "operator": self.policy.operator,
            "pattern": self.policy.pattern,
            "priority": self.policy.priority,
            "key": self.key,
            "value": self.value,
            "queue": self.queue,
            "role": self.role,
            "owner": self.owner,
            "effect": self.effect,
        }


def matches(policy: LivePolicy, name: str, queue_type: str) -> bool:
    """Whether ``policy`` reaches the queue ``name`` of ``queue_type``."""
    if policy.apply_to not in ("queues", "all", f"{queue_type}_queues"):
        return False
    try:
        return re.search(policy.pattern, name) is not None
    except re.error:  # a pattern only Erlang's regex engine reads: taken as matching
        return True


def top(policies: list[LivePolicy]) -> list[LivePolicy]:
    if not policies:
        return []
    best = max(p.priority for p in policies)
    return sorted((p for p in policies if p.priority == best), key=lambda p: p.name)


def _number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def policy_hazards(plan: Plan, live: LiveState) -> list[PolicyHazard]:
    """Every key of another policy or operator policy that would drop, expire or limit the
    messages of a queue of ``plan`` (main queues, lanes, tiers, parking and held queues)."""
    ours = {p.name: p for p in plan.policies}
    # The file's queues' own policies it no longer declares: apply deletes them, and what they
    # hid on their queue applies then.
    deleted = {naming.policy_name(q.name) for q in plan.main_queues} - set(ours)
    # The policies as they will be once apply has run: the file's own at the priority and
    # pattern it gives them (a lowered priority lets another policy win), new ones included.
    after = [p for p in live.policies if p.operator or p.name not in ours] + [
        LivePolicy(p.name, p.pattern, p.apply_to, p.definition, p.priority) for p in ours.values()]
    found: list[PolicyHazard] = []
    for queue in plan.queues:
        matching = [p for p in after if matches(p, queue.name, queue.queue_type)
                    and (p.operator or p.name not in deleted)]
        regular = top([p for p in matching if not p.operator])
        operators = top([p for p in matching if p.operator])
        # The file's own policy (as apply sets it) and the others that apply: the operator
        # policy is merged with them, and where one sets a lower value, that one is in effect.
        lower = lowest_limits(p.definition for p in regular)
        for policy in regular:
            if policy.name not in ours:
                found += _hazards(policy, queue, {})
        for policy in operators:
            found += _hazards(policy, queue, lower)
    return found


def lowest_limits(definitions: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per key of ``KEYS``, the lowest number the definitions set."""
    lower: dict[str, int] = {}
    for definition in definitions:
        for key in KEYS:
            value = _number(definition.get(key))
            if value is not None:
                lower[key] = min(value, lower.get(key, value))
    return lower


def _hazards(policy: LivePolicy, queue: Queue, lower: Mapping[str, Any]) -> list[PolicyHazard]:
    out = []
    definition = policy.definition
    for key in KEYS:
        value = _number(definition.get(key))
        if value is None:
            continue
        kept = [_number(queue.arguments.get(_ARGUMENT[key])), _number(lower.get(key))]
        if any(other is not None and other <= value for other in kept):
            continue  # a lower limit of the file's own applies
        overflow = queue.arguments.get("x-overflow") or definition.get("overflow")
        effect = _effect(key, value, queue, str(overflow or "drop-head"))
        if effect is not None:
            out.append(PolicyHazard(policy, key, value, queue.name, queue.role, queue.owner,
                                    effect))
    return out


def _effect(key: str, value: int, queue: Queue, overflow: str) -> str | None:
    """What ``key: value`` does to the messages of ``queue``; None when it does nothing."""
    role = queue.role
    keeps = role in ("parking", "held")  # no dead-letter target: what leaves is gone
    held = "parked" if role == "parking" else "held" if role == "held" else ""
    if key == "message-ttl":
        if role == "tier":
            return f"retried messages come back after {_ms(value)}, sooner than the tier's delay"
        if keeps:
            return f"deletes {held} messages {_ms(value)} after they arrive"
        return (f"expires messages that wait longer than {_ms(value)}: they leave without a "
                "handler call, into the retry tiers, and the broker drops those that expire "
                "again (a dead-letter cycle)")
    if key == "expires":
        unused = ("a tier never has a consumer" if role == "tier"
                  else "no consumer, no get")
        return f"deletes the queue and every message in it after {_ms(value)} unused ({unused})"
    if key in ("max-length", "max-length-bytes"):
        limit = plural(value, "message") if key == "max-length" else plural(value, "byte")
        if overflow != "drop-head":
            return f"refuses messages beyond {limit} ({overflow})"
        if keeps:
            return f"deletes the oldest {held} messages beyond {limit}"
        if role == "tier":
            return f"beyond {limit}, sends the oldest back before their delay"
        return (f"beyond {limit}, dead-letters the oldest without a handler call, into the "
                "retry tiers, and the broker drops those that overflow again (a dead-letter "
                "cycle)")
    if key == "delivery-limit":
        if queue.queue_type != "quorum" or role == "tier":
            return None  # classic queues have no delivery limit; nothing consumes a tier
        if keeps:
            return (f"deletes a {held} message returned {plural(value, 'time')} (every peek "
                    "returns one on 3.10-4.2)")
        return (f"dead-letters a message after {plural(value, 'return')}, a limit the worker "
                "does not know (set delivery_limit in the file's policy block instead)")
    return None


def _ms(value: int) -> str:
    return label(value) if value > 0 else f"{value} ms"


def hazard_lines(hazards: Iterable[PolicyHazard]) -> list[str]:
    """One line per policy, key and kind of queue: which queues, and what it does to them."""
    groups: dict[tuple[str, str, Any, str, str], list[str]] = {}
    for h in hazards:
        groups.setdefault((h.source, h.key, h.value, h.role, h.effect), []).append(h.queue)
    lines = []
    for (source, key, value, role, effect), names in groups.items():
        shown = ", ".join(names[:_SHOWN])
        if len(names) > _SHOWN:
            shown += f" and {len(names) - _SHOWN} more"
        noun = _ROLE_NAMES.get(role, "queue")
        queues = f"{noun} {shown}" if len(names) == 1 else f"{len(names)} {noun}s ({shown})"
        lines.append(f"{source} sets {key} {value} on {queues}: {effect}")
    return lines
