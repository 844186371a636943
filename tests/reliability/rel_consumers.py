"""Consumers the reliability tests run in real ``rabbit-retry worker`` processes.

Each handler call and each success is appended to a file under ``$RR_RECORD_DIR`` with one
``os.write`` on an ``O_APPEND`` descriptor: the line is in the kernel before ``handle`` returns,
so a SIGKILL of the worker afterwards cannot take it back (that is the "durable record" the
conservation checks count; in-process memory would die with the worker).

What a message makes the handler do is written in its JSON body::

    {"id": "m-1", "fail": 2}             # raise a transient error on attempts 1 and 2
    {"id": "m-2", "permanent": true}     # raise Permanent: park at once
    {"id": "m-3", "fixable": true}       # Permanent until the file $RR_RECORD_DIR/fixed exists
    {"id": "m-4", "raise": "huge-message"}   # one of the nasty exceptions of ``nasty()``
    {"id": "m-5", "crash": 300}          # after 300 ms the whole process dies (os._exit)
    {"id": "m-6", "sleep": 5000}         # takes 5 s (a slow one among fast ones)

A body that is not JSON makes ``delivery.payload`` raise, which parks the message ``invalid``.
Lines are ``<message id> <attempt> <pid>``; the message id is the AMQP ``message_id``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rabbit_retry import Delivery, Idempotency, Pause, Permanent, RetryConsumer

RECORD_DIR = os.environ.get("RR_RECORD_DIR", ".")
SLEEP_S = float(os.environ.get("RR_SLEEP_MS", "0")) / 1000
PREFETCH = int(os.environ.get("RR_PREFETCH", "20"))
FIXED = Path(RECORD_DIR) / "fixed"
DOWN = Path(RECORD_DIR) / "down"


def record(kind: str, delivery: Delivery) -> None:
    line = f"{delivery.message_id} {delivery.attempt} {os.getpid()}\n"
    # Each kind on its own, and both in one file in the order they happened (ordered keys).
    for name, text in ((kind, line), ("events", f"{kind} {line}")):
        fd = os.open(os.path.join(RECORD_DIR, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


class Transient(RuntimeError):
    """A failure that goes away by itself (the next attempt succeeds)."""


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ itself fails")


def _deep(n: int, exc: BaseException) -> None:
    if n == 0:
        raise exc
    _deep(n - 1, exc)


def nasty(kind: str) -> None:
    """Raise an exception that is hard to write into a header."""
    if kind == "huge-message":
        raise Permanent("x" * (5 * 1024 * 1024))
    if kind == "huge-multibyte":
        raise Permanent("é€😀\n" * (1024 * 1024))
    if kind == "deep-trace":  # ~900 frames: a traceback far longer than any header may be
        _deep(900, Permanent("deep " + "y" * 100_000))
    if kind == "huge-cause":
        try:
            raise ValueError("cause " + "z" * (3 * 1024 * 1024))
        except ValueError as cause:
            raise Permanent("wrapped") from cause
    if kind == "broken-str":
        raise BrokenStr()
    if kind == "surrogate":  # what a surrogateescape-decoded file name or body looks like
        raise Permanent(b"cannot open /data/\xff\xfe.csv".decode("utf-8", "surrogateescape"))
    if kind == "transient-huge":  # retried (a transient failure) and then parked exhausted
        raise Transient("t" * (4 * 1024 * 1024))
    raise AssertionError(f"unknown nasty kind {kind!r}")


class _Behaviour(RetryConsumer):
    prefetch = PREFETCH
    handler_timeout = 30.0

    async def handle(self, delivery: Delivery) -> None:
        record("calls", delivery)
        spec: Any = delivery.payload  # a body that is not JSON parks ``invalid`` here
        if isinstance(spec, dict) and "crash" in spec:
            # A poison message: a segfault, an OOM kill, an abort() in a C library.
            await asyncio.sleep(float(spec["crash"]) / 1000)
            os._exit(70)
        if SLEEP_S:
            await asyncio.sleep(SLEEP_S)
        if not isinstance(spec, dict):
            spec = {}
        if spec.get("sleep"):  # this message's own handling time, in ms
            await asyncio.sleep(float(spec["sleep"]) / 1000)
        if spec.get("permanent"):
            raise Permanent(f"declined {delivery.message_id}")
        if spec.get("fixable") and not FIXED.exists():
            raise Permanent(f"not fixed yet: {delivery.message_id}")
        if delivery.attempt <= int(spec.get("fail", 0)):
            raise Transient(f"transient {delivery.message_id} attempt {delivery.attempt}")
        if spec.get("raise"):
            nasty(str(spec["raise"]))
        record("ok", delivery)


class Orders(_Behaviour):
    queue = "rel.orders"


class Payments(_Behaviour):
    queue = "rel.payments"


class Points(_Behaviour):
    """``rel.points``, an ordered queue keyed by header ``user-id`` (test_ordered_faults)."""

    queue = "rel.points"


class Outage(ConnectionError):
    """The downstream is down: while the file $RR_RECORD_DIR/down exists (``PausedPoints``)."""


class PausedPoints(Points):
    """``Points`` behind a downstream that is down while ``down`` exists; its queue pauses."""

    pause = Pause(after=3, on=(Outage,), probe_every=0.2)

    async def handle(self, delivery: Delivery) -> None:
        if DOWN.exists():
            record("calls", delivery)
            raise Outage(f"ledger unreachable ({delivery.message_id})")
        await super().handle(delivery)


class Order(BaseModel):
    id: str
    amount: int


class Typed(RetryConsumer):
    """A consumer with a pydantic ``model``: invalid bodies park before ``handle`` runs."""

    queue = "rel.typed"
    prefetch = PREFETCH
    model = Order

    async def handle(self, delivery: Delivery) -> None:
        record("calls", delivery)
        record("ok", delivery)


def _idempotency() -> Idempotency | None:
    store = os.environ.get("RR_STORE")
    # A short lease: a claim left by a SIGKILLed worker runs out quickly in the tests.
    return Idempotency(store, window=3600, lease=3.0) if store else None


class IdemOrders(Orders):
    """``Orders`` with ``Idempotency`` on the store named by ``$RR_STORE``."""

    idempotency = _idempotency()
