"""One timer for all of a consumer's handler timeouts (worker/deadlines.py): each handler is
cancelled at its own deadline, in whatever order they were started, and one that finished in
time is never touched."""

from __future__ import annotations

import asyncio

from rabbit_retry.worker.deadlines import Deadlines


async def _watched(deadlines: Deadlines, seconds: float, sleep: float) -> tuple[str, bool]:
    task = asyncio.current_task()
    assert task is not None
    deadlines.start(task, seconds)
    try:
        await asyncio.sleep(sleep)
    except asyncio.CancelledError:
        expired = deadlines.finish(task)
        task.uncancel()
        return "cancelled", expired
    return "finished", deadlines.finish(task)


async def test_each_handler_is_cancelled_at_its_own_deadline_in_any_order() -> None:
    deadlines = Deadlines()
    # Started first with a long deadline, then a short one: the timer must move earlier.
    slow_but_in_time = asyncio.create_task(_watched(deadlines, 60, 0.2))
    await asyncio.sleep(0)
    overdue = asyncio.create_task(_watched(deadlines, 0.05, 60))
    quick = asyncio.create_task(_watched(deadlines, 30, 0))
    assert await overdue == ("cancelled", True)
    assert await quick == ("finished", False)
    assert await slow_but_in_time == ("finished", False)


async def test_a_cancellation_that_is_not_the_deadline_reads_as_such() -> None:
    deadlines = Deadlines()
    task = asyncio.create_task(_watched(deadlines, 60, 60))
    await asyncio.sleep(0)
    task.cancel()  # a shutdown, not a timeout
    assert await task == ("cancelled", False)


async def test_the_timer_follows_the_next_deadline_after_firing() -> None:
    deadlines = Deadlines()
    first = asyncio.create_task(_watched(deadlines, 0.02, 60))
    second = asyncio.create_task(_watched(deadlines, 0.1, 60))
    assert await first == ("cancelled", True)
    assert await second == ("cancelled", True)


def test_a_new_event_loop_starts_afresh() -> None:
    deadlines = Deadlines()
    for _ in range(2):  # a timer of the first loop must not be used (or fire) in the second
        assert asyncio.run(_watched(deadlines, 0.02, 60)) == ("cancelled", True)
