"""How messages to the user write values and counts: short, and as a YAML file would say them."""

from __future__ import annotations

from datetime import date

# A 255-byte name quoted whole would push the rest of a message off the line.
MAX_CHARS = 72
_HEAD_CHARS = 60
_TAIL_CHARS = MAX_CHARS - _HEAD_CHARS - len("...")


def clip(text: str) -> str:
    """``text`` cut in the middle to at most ``MAX_CHARS`` characters."""
    if len(text) <= MAX_CHARS:
        return text
    return text[:_HEAD_CHARS] + "..." + text[-_TAIL_CHARS:]


def shorten(value: object) -> str:
    """``value`` as a message quotes it: in YAML's words (null, true, a mapping, a list), a
    string or a number as its Python literal, cut to ``MAX_CHARS``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, date):
        return f"{value.isoformat()} (a date)"
    return clip(repr(value))


def numbered(noun: str, first: int, end: int) -> str:
    """``noun`` numbers ``first`` to ``end - 1``: "lane 2", "lanes 2-3"."""
    return f"{noun} {first}" if end == first + 1 else f"{noun}s {first}-{end - 1}"


def plural(count: int, noun: str) -> str:
    """``1 queue``, ``2 queues``: ``noun`` with an ``s`` unless ``count`` is 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
