"""Derived names of product.md section 3: every object one queue ``Q`` compiles to."""

from __future__ import annotations

from rabbit_retry.topology.durations import label

RETRY_SUFFIX = ".retry"
PARKING_SUFFIX = ".parking"


def retry_exchange(queue: str) -> str:
    return queue + RETRY_SUFFIX


def tier_queue(queue: str, delay_ms: int) -> str:
    return f"{queue}{RETRY_SUFFIX}.{label(delay_ms)}"


def tier_prefix(queue: str) -> str:
    """Every tier queue of ``queue``, old or new, starts with this."""
    return queue + RETRY_SUFFIX + "."


def parking_queue(queue: str) -> str:
    return queue + PARKING_SUFFIX


def main_queue_of_parking(name: str) -> str | None:
    """``Q`` for ``Q.parking``; None if ``name`` is not a parking queue's name."""
    if name.endswith(PARKING_SUFFIX) and len(name) > len(PARKING_SUFFIX):
        return name[: -len(PARKING_SUFFIX)]
    return None
