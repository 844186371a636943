"""Derived names: every object one queue ``Q`` compiles to (README, "What one queue `Q` compiles
to"), and the way back from such a name to ``Q``."""

from __future__ import annotations

import re

from rabbit_retry.topology.durations import label, parse_duration

RETRY_SUFFIX = ".retry"
PARKING_SUFFIX = ".parking"
MIGRATING_SUFFIX = ".migrating"
LANES_SUFFIX = ".lanes"
LANE_INFIX = ".lane."
HELD_SUFFIX = ".held"
RESCUE_SUFFIX = ".rescue"
POLICY_PREFIX = "rabbit-retry:"
# The queue ``apply`` and ``migrate`` hold, exclusive, while they change a vhost (broker.lock).
LOCK_QUEUE = "rabbit-retry.lock"


def retry_exchange(queue: str) -> str:
    return queue + RETRY_SUFFIX


def tier_routing_key(delay_ms: int) -> str:
    """The key on ``Q.retry`` that reaches the tier of ``delay_ms``: the delay's label, which
    also ends the tier's name."""
    return label(delay_ms)


def tier_queue(queue: str, delay_ms: int) -> str:
    return tier_prefix(queue) + label(delay_ms)


def tier_prefix(queue: str) -> str:
    """Every tier queue of ``queue``, old or new, starts with this."""
    return queue + RETRY_SUFFIX + "."


def parking_queue(queue: str) -> str:
    return queue + PARKING_SUFFIX


def lanes_exchange(queue: str) -> str:
    """The hashing exchange an ordered queue's messages enter through, to their key's lane."""
    return queue + LANES_SUFFIX


def lane_queue(queue: str, lane: int) -> str:
    """Lane ``lane`` of an ordered queue: one worker consumes it at a time."""
    return f"{queue}{LANE_INFIX}{lane}"


def lane_number(exchange: str, queue: str) -> int | None:
    """The lane ``queue`` is when bound from ``exchange``, an ordered queue's lanes exchange;
    None for any other binding."""
    if not exchange.endswith(LANES_SUFFIX):
        return None
    prefix = exchange[: -len(LANES_SUFFIX)] + LANE_INFIX
    rest = queue[len(prefix):] if queue.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def held_queue(queue: str, lane: int) -> str:
    """Where lane ``lane`` keeps the messages of its held keys, and which keys are held."""
    return lane_queue(queue, lane) + HELD_SUFFIX


def lanes_change_queue(queue: str, before: int, after: int) -> str:
    """The empty queue that marks ``rabbit-retry migrate`` adding lanes to ordered queue
    ``queue`` (from ``before`` to ``after``): it exists only until the change is made whole."""
    return f"{lanes_exchange(queue)}.{before}-to-{after}"


def migrating_queue(queue: str) -> str:
    """The holding queue ``rabbit-retry migrate`` keeps ``queue``'s messages in meanwhile."""
    return queue + MIGRATING_SUFFIX


def rescue_queue(queue: str) -> str:
    """Where ``rabbit-retry rescue`` collects what the broker's dead-letter cycle check holds in
    ``queue`` (docs/versions.md, "Stranded messages"); it exists only while a rescue runs."""
    return queue + RESCUE_SUFFIX


def policy_name(queue: str) -> str:
    """The one policy rabbit-retry manages for ``queue`` (its file's ``policy`` block)."""
    return POLICY_PREFIX + queue


def policy_pattern(queue: str) -> str:
    """A pattern that matches ``queue`` and nothing else."""
    return "^" + re.escape(queue) + "$"


def main_queue_of_parking(name: str) -> str | None:
    """``Q`` for ``Q.parking``; None if ``name`` is not a parking queue's name."""
    return _before_suffix(name, PARKING_SUFFIX)


def main_queue_of_retry_exchange(name: str) -> str | None:
    """``Q`` for ``Q.retry``; None if ``name`` is not a retry exchange's name."""
    return _before_suffix(name, RETRY_SUFFIX)


def tier_label_of(name: str, queue: str) -> str | None:
    """``5s`` for ``Q.retry.5s`` of ``queue`` Q; None if ``name`` is not shaped like its tier."""
    prefix = tier_prefix(queue)
    if not name.startswith(prefix):
        return None
    suffix = name[len(prefix) :]
    try:
        ms = parse_duration(suffix)
    except ValueError:
        return None
    return suffix if label(ms) == suffix else None


def tier_namespace_owners(name: str) -> list[str]:
    """Every ``Q`` whose tier names (``Q.retry.*``) ``name`` is among, shortest first: ``Q`` may
    itself contain dots, so ``a.retry.b.retry.5s`` is under both ``a`` and ``a.retry.b``."""
    marker = tier_prefix("")
    owners = []
    start = name.find(marker, 1)
    while start != -1:
        owners.append(name[:start])
        start = name.find(marker, start + 1)
    return owners


def _before_suffix(name: str, suffix: str) -> str | None:
    if name.endswith(suffix) and len(name) > len(suffix):
        return name[: -len(suffix)]
    return None
