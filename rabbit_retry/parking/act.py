"""Changing a parking queue: ``replay`` (back to the main queue) and ``purge`` (delete).

Both walk the queue from the head once, act on the messages ``Selection`` matches and leave the
others parked in their order; see session.py for why nothing can be lost on the way.
"""

from __future__ import annotations

import asyncio
import getpass
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rabbit_retry import tracing
from rabbit_retry.errors import RabbitRetryError
from rabbit_retry.parking.filters import Selection
from rabbit_retry.parking.session import (
    ParkingQueue,
    Taken,
    Target,
    management_kind_of,
    open_parking,
)
from rabbit_retry.settings import Settings

# scanned, acted on, total to scan
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Outcome:
    target: Target
    ready: int  # messages parked when we started
    scanned: int
    acted: int  # replayed or deleted

    @property
    def left(self) -> int:
        """Of the messages parked when we started, how many are still parked."""
        return self.ready - self.acted


class Pacer:
    """At most ``rate`` actions a second, spread evenly (no bursts after a slow stretch)."""

    def __init__(
        self,
        rate: float | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self._interval = 1.0 / rate if rate else 0.0
        self._clock = clock
        self._sleep = sleep
        self._next: float | None = None

    async def wait(self) -> None:
        if not self._interval:
            return
        now = self._clock()
        if self._next is not None and now < self._next:
            await self._sleep(self._next - now)
            now = self._next
        self._next = now + self._interval


async def _walk(
    parking: ParkingQueue,
    selection: Selection,
    act: Callable[[Taken], Awaitable[None]],
    limit: int | None,
    progress: Progress | None,
    verb: str,
) -> Outcome:
    acted = 0
    while limit is None or acted < limit:
        taken = await parking.take()
        if taken is None:
            break
        if selection.matches(taken.message.headers):
            try:
                await act(taken)
            except RabbitRetryError as exc:
                # Say how far it got: everything after this point is still parked.
                raise type(exc)(
                    f"{verb} stopped after {acted} of {parking.ready} parked messages in "
                    f"{parking.target.parking!r}: {exc}"
                ) from exc
            acted += 1
        if progress is not None:
            progress(parking.taken, acted, parking.ready)
    return Outcome(parking.target, parking.ready, parking.taken, acted)


async def replay(
    settings: Settings,
    name: str,
    selection: Selection,
    *,
    limit: int | None = None,
    rate: float | None = None,
    progress: Progress | None = None,
    handle_again: bool = False,
) -> Outcome:
    """Moves up to ``limit`` matching messages back to the main queue: each copy is confirmed
    by the broker before its parked original is acked. ``handle_again`` marks the copies to be
    handled even where an idempotent consumer already handled their key. In a process that
    traces, the replay is one span that every copy carries (``rabbit_retry.tracing``)."""
    pacer = Pacer(rate)
    attributes = {"rabbit_retry.actor": _operator(), "rabbit_retry.broker_user": settings.user,
                  "rabbit_retry.handle_again": handle_again, "messaging.destination.name": ""}
    with tracing.replay_span("parking replay", attributes) as trace:
        async with open_parking(
            settings, name, need_main=True, kind_of=management_kind_of(settings)
        ) as parking:
            if trace is not None:
                trace.note({"messaging.rabbitmq.destination.routing_key": parking.target.main,
                            "rabbit_retry.parking_queue": parking.target.parking})

            async def move(taken: Taken) -> None:
                await pacer.wait()
                await parking.replay(taken, handle_again=handle_again, trace=trace)

            return await _walk(parking, selection, move, limit, progress, "replay")


def _operator() -> str | None:
    """Who runs the command, as the operating system knows them (a replay's actor)."""
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (a container): the span says nothing
        return None


async def purge(
    settings: Settings,
    name: str,
    selection: Selection,
    *,
    limit: int | None = None,
    progress: Progress | None = None,
) -> Outcome:
    """Deletes up to ``limit`` matching messages. Without a filter it deletes the messages that
    were parked when it started, one by one, never ``queue.purge``: a message parked while the
    operator confirmed is not deleted unseen."""
    async with open_parking(settings, name, kind_of=management_kind_of(settings)) as parking:
        return await _walk(parking, selection, parking.discard, limit, progress, "purge")
