"""Batch handlers: ``batch = Batch(size, wait)`` and ``handle_batch(deliveries)``, with an outcome
per delivery.

A batch is a grouping of deliveries that each still take their own way through the worker
(``session``): each is read, validated against the consumer's ``model`` (an invalid body is
parked before any batch), checked against ``Idempotency`` and given its turn on the lane on its
own; only the handler call is shared. The call's result is then split back into one outcome per
delivery (``outcomes``, pure), and each delivery is decided and carried out as if ``handle`` had
returned or raised that outcome: its own attempt count, tier, headers, park reason. Successes
are settled together by the channel's ``Settler`` (one ``basic.ack`` with ``multiple`` for the
run), a failure's copy is confirmed before its own ack, as always.

``Batcher`` collects one stream's deliveries: a batch is handed to ``handle_batch`` once it holds
``size`` deliveries, or ``wait`` seconds after its first one arrived, whichever comes first. A
delivery that runs alone (it came back without a verdict, or a pause's probe) is a batch of
its own, at once: it may be what crashed the worker, and must not take others down with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from rabbit_retry.errors import InputError

if TYPE_CHECKING:
    from rabbit_retry.worker.consumer import Delivery
    from rabbit_retry.worker.decide import Outcome

MAX_BATCH = 65535  # a channel's prefetch cannot be larger, so no batch can be either


@dataclass(frozen=True, slots=True)
class Batch:
    """``handle_batch`` gets up to ``size`` deliveries at once, or what came within ``wait``
    seconds of the first."""

    size: int
    wait: float = 0.2

    def check(self, consumer: str) -> None:
        size, wait = self.size, self.wait
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH:
            raise InputError(
                f"{consumer}.batch: size must be an integer from 1 to {MAX_BATCH}, got {size!r}"
            )
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait > 0:
            raise InputError(
                f"{consumer}.batch: wait must be a positive number of seconds, got {wait!r}"
            )


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What ``handle_batch`` says of its deliveries: ``failed`` maps each delivery that failed
    (the ``Delivery`` object it was given) to its exception, which decides its path as if
    ``handle`` had raised it; every delivery not named succeeded."""

    failed: Mapping[Delivery[Any], BaseException] = field(default_factory=dict)


class BatchError(Exception):
    """``handle_batch`` returned something the worker cannot split per delivery: every delivery
    of the batch fails with it, so no message is taken for done by mistake. Always transient
    (retried): not a ``TypeError``, so a consumer's ``permanent_errors`` cannot park a batch for
    a result the handler got wrong."""


def outcomes(
    deliveries: Sequence[Delivery[Any]], returned: object
) -> list[Outcome | Exception]:
    """One outcome per delivery of a batch whose call returned ``returned`` (what ``session``
    makes of a single handler's result: ``SUCCESS``, or the exception)."""
    from rabbit_retry.worker.decide import Outcome

    if returned is None:
        return [Outcome.SUCCESS] * len(deliveries)
    if not isinstance(returned, BatchResult):
        return [BatchError(
            f"handle_batch returned {type(returned).__name__}; expected BatchResult or None"
        )] * len(deliveries)
    failed = returned.failed
    if not isinstance(failed, Mapping):
        return [BatchError(
            f"BatchResult.failed is {type(failed).__name__}; expected a mapping of the failed"
            " deliveries to their exceptions"
        )] * len(deliveries)
    given = {id(d) for d in deliveries}
    for key, error in failed.items():
        if id(key) not in given:
            return [BatchError(
                f"BatchResult.failed names {key!r}, which is not one of the deliveries of this"
                " batch (key it by the Delivery objects handle_batch was given)"
            )] * len(deliveries)
        if not isinstance(error, Exception):
            return [BatchError(
                f"BatchResult.failed[{key!r}] is {error!r}; expected an exception instance"
            )] * len(deliveries)
    return [cast(Exception, failed[d]) if d in failed else Outcome.SUCCESS for d in deliveries]


Waiting = tuple["Delivery[Any]", "asyncio.Future[Outcome | Exception]"]


class Batcher:
    """Collects deliveries into batches and runs ``call`` on each; each delivery's ``join``
    returns its own outcome. ``track`` is told of each batch's task (shutdown waits for it and
    cancels it with the deliveries it serves)."""

    __slots__ = ("_call", "_closed", "_pending", "_rule", "_timer", "_track")

    def __init__(
        self,
        rule: Batch,
        call: Callable[[list[Delivery[Any]]], Awaitable[list[Outcome | Exception]]],
        track: Callable[[asyncio.Task[Any]], None],
    ) -> None:
        self._rule = rule
        self._call = call
        self._track = track
        self._pending: list[Waiting] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False  # the worker is stopping: nothing waits to be collected

    async def join(self, delivery: Delivery[Any], *, alone: bool = False) -> Outcome | Exception:
        """Add ``delivery`` to the next batch (or run it as a batch of one: ``alone``, or once
        the batcher is closed); its outcome once the batch ran. A cancelled ``join`` leaves the
        batch to the others."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome | Exception] = loop.create_future()
        if alone or self._closed:
            self._start([(delivery, future)])
        else:
            pending = self._pending
            pending.append((delivery, future))
            if len(pending) >= self._rule.size:
                self.flush()
            elif len(pending) == 1:
                self._timer = loop.call_later(self._rule.wait, self.flush)
        return await future

    def flush(self) -> None:
        """Hand what is collected to the handler now (its size or its wait is reached)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        # Deliveries whose task was cancelled while they waited (a lost connection) stay out.
        batch = [w for w in batch if not w[1].done()]
        if batch:
            self._start(batch)

    def close(self) -> None:
        """The worker is stopping: what is collected runs now, and a delivery that joins later
        (it was still on its way, an idempotency check say) runs at once, as a batch of its
        own, within the stop's grace."""
        self._closed = True
        self.flush()

    def _start(self, batch: list[Waiting]) -> None:
        self._track(asyncio.ensure_future(self._run(batch)))

    async def _run(self, batch: list[Waiting]) -> None:
        try:
            results = await self._call([delivery for delivery, _ in batch])
        except Exception as exc:  # a fault of the worker's: each delivery fails with it
            results = [exc] * len(batch)
        except BaseException:  # cancelled (a stop, a lost connection): so are its deliveries
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
