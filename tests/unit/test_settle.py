"""Acks in groups: which ``basic.ack`` frames a channel's settled deliveries become."""

from __future__ import annotations

import asyncio

from rabbit_retry.worker.settle import STRAGGLER_S, Settler


class Channel:
    """Records the acks a settler sends (what the broker would see, in order)."""

    def __init__(self) -> None:
        self.acks: list[tuple[int, bool]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
        self.acks.append((tag, multiple))


async def spin() -> None:
    """Let the loop go round: the idle flush, then the ack it sends."""
    for _ in range(3):
        await asyncio.sleep(0)


def acked(acks: list[tuple[int, bool]]) -> set[int]:
    """The tags those frames acknowledge, as the broker applies them (multiple: every tag up to
    it not acked yet)."""
    done: set[int] = set()
    for tag, multiple in acks:
        done |= set(range(1, tag + 1)) if multiple else {tag}
    return done


async def settle(run: int, received: list[int], done: list[int], elsewhere: list[int] = ()
                 ) -> tuple[Channel, Settler]:
    channel = Channel()
    settler = Settler(channel, run)  # type: ignore[arg-type]
    for tag in received:
        settler.received(tag)
    for tag in elsewhere:
        settler.elsewhere(tag)
    for tag in done:
        settler.done(tag)
    await spin()  # the loop runs what was ready: the idle flush
    await settler.flush()
    return channel, settler


async def test_deliveries_finishing_together_share_one_frame() -> None:
    channel, _ = await settle(100, list(range(1, 51)), list(range(1, 51)))
    assert channel.acks == [(50, True)]


async def test_a_full_run_goes_at_once() -> None:
    channel = Channel()
    settler = Settler(channel, 10)  # type: ignore[arg-type]
    for tag in range(1, 26):
        settler.received(tag)
        settler.done(tag)
    await spin()
    assert channel.acks[:2] == [(10, True), (20, True)]
    assert acked(channel.acks) == set(range(1, 26))


async def test_an_open_delivery_ends_the_run_and_is_never_covered() -> None:
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
    for tag in (1, 2, 3, 5, 6, 7):  # 4 still runs
        settler.done(tag)
    await spin()
    assert channel.acks == [(3, True)]
    # Behind 4, 5-7 wait a moment for it; it finishing in that moment makes them one run.
    settler.done(4)
    await spin()
    assert channel.acks == [(3, True), (7, True)]


async def test_done_deliveries_stuck_behind_a_held_one_are_acked_alone_soon() -> None:
    """A copy waiting for its confirm (its parking queue missing) holds its delivery open for
    minutes; the done ones behind it must not hold their prefetch slots meanwhile, even when
    nothing else happens on the channel (a worker whose every slot is taken)."""
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
    for tag in (1, 2, 3, 5, 6, 7):  # 4 is held
        settler.done(tag)
    await spin()
    assert channel.acks == [(3, True)]
    await asyncio.sleep(STRAGGLER_S * 3)
    assert acked(channel.acks) == {1, 2, 3, 5, 6, 7}
    assert channel.acks[1:] == [(5, False), (6, False), (7, False)]
    settler.done(4)
    settler.done(8)
    await settler.flush()
    assert channel.acks[-1] == (8, True)  # 4 and 8, the rest skipped: acked already
    assert acked(channel.acks) == set(range(1, 9))


async def test_deliveries_settled_otherwise_are_skipped_never_acked() -> None:
    channel, _ = await settle(100, list(range(1, 6)), [1, 2, 4, 5], elsewhere=[3])
    assert channel.acks == [(5, True)]  # 3 was nacked: covered by nothing but its own nack
    channel, _ = await settle(100, list(range(1, 6)), [1, 2, 3], elsewhere=[4, 5])
    assert channel.acks == [(3, True)]  # the top tag of a multiple ack is one still unacked


async def test_never_more_than_one_run_is_done_and_unacked() -> None:
    """What a kill -9 can re-handle: a slow delivery holds the prefix, hundreds finish behind
    it; done-but-unacked never exceeds the run."""
    channel = Channel()
    settler = Settler(channel, 20)  # type: ignore[arg-type]
    settler.received(1)  # the slow one
    worst = 0
    for tag in range(2, 600):
        settler.received(tag)
        settler.done(tag)
        worst = max(worst, settler.pending)
        if tag % 7 == 0:
            await spin()
    assert worst <= 20
    await settler.flush()
    assert 1 not in acked(channel.acks)


async def test_nothing_is_sent_on_a_closed_channel() -> None:
    channel = Channel()
    settler = Settler(channel, 5)  # type: ignore[arg-type]
    settler.received(1)
    channel.is_closed = True
    settler.done(1)
    await settler.flush()
    assert channel.acks == []




async def test_ack_frames_reach_the_channel_in_the_order_they_were_decided() -> None:
    """aiormq's write queue is bounded: frames of separate tasks can overtake each other, and a
    ``multiple`` ack overtaken by a later one names a tag the broker no longer holds (it closes
    the channel: seen on 4.3). One writer hands them over in order."""

    class Slow(Channel):
        async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
            if not self.acks and tag == 5:
                await asyncio.sleep(0.02)  # the first frame waits for room in the queue
            self.acks.append((tag, multiple))

    channel = Slow()
    settler = Settler(channel, 5)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
        settler.done(tag)
    await settler.flush()
    assert channel.acks == [(5, True), (10, True)]

