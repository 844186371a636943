"""A fixed lane's turns (an ordered queue's lane), driven step by step: while paused, the probe
loop waits in ``idle()`` until nothing of the lane is held but what the pause keeps waiting; a
returned delivery waiting to run alone keeps later ones from starting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from rabbit_retry.worker.lane import Lane


class _Channel:
    """A lane's channel that is never used here: nothing consumes, nothing is settled."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the lane used its channel: {name}")


def _lane(prefetch: int) -> Lane:
    async def deliver(message: Any) -> None:
        raise AssertionError("nothing is delivered")

    return Lane(_Channel(), "q.lane.0", prefetch, 10, deliver,  # type: ignore[arg-type]
                lambda why: None, fixed=True)


def _arrivals(lane: Lane, turns: dict[str, str]) -> Callable[..., Coroutine[Any, Any, None]]:
    """A delivery's way onto ``lane`` (as the session takes it), its turn noted in ``turns``."""

    async def arrive(name: str, alone: bool = False) -> None:
        task = asyncio.current_task()
        assert task is not None
        if lane.enter(task, alone):
            turns[name] = "shared"
            return
        turns[name] = await lane.turn(task, alone, name)

    return arrive


async def _step() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_idle_returns_once_a_delivery_sent_back_by_the_pause_has_left() -> None:
    """A delivery waiting for a free slot when the pause comes is sent back ("hold") and
    leaves after its copy is confirmed, while another waits, parked. Once it has left, only the
    parked one is held: ``idle()`` returns (the probe loop goes on) without anything else
    happening on the lane. Before, its leaving woke no one and the probes stopped until the
    parked delivery's ``PAUSED_WAIT`` (300 s) ran out."""
    lane = _lane(prefetch=1)
    turns: dict[str, str] = {}
    arrive = _arrivals(lane, turns)

    running = asyncio.create_task(arrive("running"))
    await _step()
    waiting = asyncio.create_task(arrive("waiting"))  # no free slot: waits for one
    await _step()
    assert turns == {"running": "shared"}
    await lane.pause()
    await _step()
    assert turns["waiting"] == "hold"  # sent back unstarted: its copy is on its way
    parked = asyncio.create_task(arrive("parked"))
    await _step()
    assert "parked" not in turns  # waits for a probe
    idle = asyncio.create_task(lane.idle())
    lane.ran(running)
    lane.left(running)
    await _step()
    assert not idle.done()  # positive control: the delivery sent back has not left yet
    lane.left(waiting)  # its copy confirmed, acked
    await _step()
    assert idle.done(), "idle() still waits with only the parked delivery held"
    assert lane.probe() == "parked"
    await parked
    assert turns["parked"] == "shared"


async def test_a_returned_delivery_waiting_to_run_alone_keeps_later_ones_from_starting() -> None:
    """A fixed lane never stops taking deliveries. A returned delivery waits to run alone until
    nothing else runs; meanwhile a later delivery does not start beside the running one, so the
    returned one runs as soon as that one is done, then the later one. Before, each new
    delivery started while a slot was free, and the returned one (with every later message of
    its key) waited for a lull in the lane."""
    lane = _lane(prefetch=2)
    turns: dict[str, str] = {}
    arrive = _arrivals(lane, turns)

    running = asyncio.create_task(arrive("running"))
    await _step()
    returned = asyncio.create_task(arrive("returned", alone=True))
    await _step()
    later = asyncio.create_task(arrive("later"))
    await _step()
    assert turns == {"running": "shared"}, turns  # a slot is free, yet "later" waits
    lane.ran(running)
    lane.left(running)
    await _step()
    assert turns == {"running": "shared", "returned": "alone"}, turns
    lane.ran(returned)
    lane.left(returned)
    await _step()
    assert turns["later"] == "shared"
    await asyncio.gather(running, returned, later)
