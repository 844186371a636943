"""Handler timeouts (worker/deadlines.py): one timer for all of a consumer's handlers, each
cancelled at its own deadline in whatever order they started, one that finished in time never
touched; and what a handler's end stands for (``Deadlines.ended``), as the session reads it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from rabbit_retry.worker.consumer import HandlerTimeout
from rabbit_retry.worker.deadlines import Deadlines


async def _under(
    deadlines: Deadlines, seconds: float, handler: Callable[[], Awaitable[object]]
) -> BaseException | None:
    """Run ``handler`` under a ``seconds`` deadline as the session does; what its end stands
    for (None: it returned)."""
    task = asyncio.current_task()
    assert task is not None
    deadlines.start(task, seconds)
    try:
        await handler()
    except BaseException as exc:
        return deadlines.ended(task, exc, seconds)
    return deadlines.ended(task, None, seconds)


def _sleeping(seconds: float, swallow: bool = False) -> Callable[[], Awaitable[object]]:
    async def handler() -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            if not swallow:
                raise

    return handler


def _kind(what: BaseException | None) -> str:
    return type(what).__name__ if what is not None else "returned"


async def test_each_handler_is_cancelled_at_its_own_deadline_in_any_order() -> None:
    deadlines = Deadlines()
    # Started first with a long deadline, then a short one: the timer must move earlier.
    slow_but_in_time = asyncio.create_task(_under(deadlines, 60, _sleeping(0.2)))
    await asyncio.sleep(0)
    overdue = asyncio.create_task(_under(deadlines, 0.05, _sleeping(60)))
    quick = asyncio.create_task(_under(deadlines, 30, _sleeping(0)))
    assert _kind(await overdue) == "HandlerTimeout"
    assert _kind(await quick) == "returned"
    assert _kind(await slow_but_in_time) == "returned"


async def test_the_timer_follows_the_next_deadline_after_firing() -> None:
    deadlines = Deadlines()
    first = asyncio.create_task(_under(deadlines, 0.02, _sleeping(60)))
    second = asyncio.create_task(_under(deadlines, 0.1, _sleeping(60)))
    assert _kind(await first) == "HandlerTimeout"
    assert _kind(await second) == "HandlerTimeout"


def test_a_new_event_loop_starts_afresh() -> None:
    deadlines = Deadlines()
    for _ in range(2):  # a timer of the first loop must not be used (or fire) in the second
        assert _kind(asyncio.run(_under(deadlines, 0.02, _sleeping(60)))) == "HandlerTimeout"


async def test_a_timeout_names_its_seconds_keeps_the_traceback_and_leaves_no_cancellation() -> None:
    what = await _under(Deadlines(), 0.05, _sleeping(10))
    assert isinstance(what, HandlerTimeout)
    assert str(what) == "the handler did not finish within 0.05s"
    assert what.__traceback__ is not None
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending for our own next await


async def test_what_a_handler_raises_in_time_is_what_it_raised() -> None:
    error = KeyError("sku")

    async def raises() -> None:
        raise error

    assert await _under(Deadlines(), 5, raises) is error


async def test_a_shutdown_cancel_is_not_a_timeout() -> None:
    task = asyncio.create_task(_under(Deadlines(), 5, _sleeping(10)))
    await asyncio.sleep(0.05)
    task.cancel()
    assert _kind(await task) == "CancelledError"


async def test_a_shutdown_cancel_after_the_deadline_stays_a_cancellation() -> None:
    timed_out = asyncio.Event()

    async def handler() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            timed_out.set()  # the deadline's cancellation, swallowed
        await asyncio.sleep(10)

    task = asyncio.create_task(_under(Deadlines(), 0.05, handler))
    await timed_out.wait()  # the deadline fired (the positive control) ...
    task.cancel()  # ... and a shutdown asks too
    assert _kind(await task) == "CancelledError"


async def test_a_handler_that_swallows_the_timeout_keeps_its_result() -> None:
    assert await _under(Deadlines(), 0.05, _sleeping(10, swallow=True)) is None
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0)


@pytest.mark.parametrize("seconds", [0.05, 60])
async def test_a_deadline_dropped_in_time_never_fires(seconds: float) -> None:
    deadlines = Deadlines()
    assert await _under(deadlines, seconds, _sleeping(0)) is None
    await asyncio.sleep(0.1)  # past the short deadline: nothing may be cancelled now
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
