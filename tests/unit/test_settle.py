"""Acks in groups: which ``basic.ack`` frames a channel's settled deliveries become."""

from __future__ import annotations

import asyncio

import pytest

from rabbit_retry.worker.settle import LINGER_S, STRAGGLER_S, Settler


class Channel:
    """Records the acks a settler sends (what the broker would see, in order)."""

    def __init__(self) -> None:
        self.acks: list[tuple[int, bool]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
        self.acks.append((tag, multiple))


class Clock:
    """The event loop's clock, moved by hand: its timers fire when the test says time passed
    (every test here runs on it: on a busy machine a real sleep of a few linger periods can end
    before a re-armed check does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        loop = asyncio.get_running_loop()
        self.now = loop.time()
        monkeypatch.setattr(loop, "time", lambda: self.now)

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        for _ in range(5):  # the timers now due, then the frames they queued
            await asyncio.sleep(0)


@pytest.fixture(autouse=True)
async def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


async def spin(clock: Clock) -> None:
    """Let the channel go quiet: the run that is not full goes, then its frame is written."""
    for _ in range(3):
        await clock.advance(LINGER_S)


def acked(acks: list[tuple[int, bool]]) -> set[int]:
    """The tags those frames acknowledge, as the broker applies them (multiple: every tag up to
    it not acked yet)."""
    done: set[int] = set()
    for tag, multiple in acks:
        done |= set(range(1, tag + 1)) if multiple else {tag}
    return done


async def settle(clock: Clock, run: int, received: list[int], done: list[int],
                 elsewhere: list[int] = ()) -> tuple[Channel, Settler]:
    channel = Channel()
    settler = Settler(channel, run)  # type: ignore[arg-type]
    for tag in received:
        settler.received(tag)
    for tag in elsewhere:
        settler.elsewhere(tag)
    for tag in done:
        settler.done(tag)
    await spin(clock)  # the loop runs what was ready: the idle flush
    await settler.flush()
    return channel, settler


async def test_deliveries_finishing_together_share_one_frame(clock: Clock) -> None:
    channel, _ = await settle(clock, 100, list(range(1, 51)), list(range(1, 51)))
    assert channel.acks == [(50, True)]


async def test_a_run_grows_while_deliveries_keep_coming_and_goes_once_the_channel_is_quiet(
    clock: Clock,
) -> None:
    """Sent at the first turn of the loop without a delivery finishing, a run ended between
    two reads of the socket (under 7 deliveries a frame); it waits for a quiet channel now."""
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    for tag in range(1, 31):  # one arriving and finishing every 0.6 of LINGER_S: 18 linger
        settler.received(tag)
        await clock.advance(LINGER_S * 0.3)
        settler.done(tag)
        await clock.advance(LINGER_S * 0.3)
    assert channel.acks == []
    await clock.advance(LINGER_S)  # quiet for a linger: the check may have looked just before
    await clock.advance(LINGER_S)
    assert channel.acks == [(30, True)]


async def test_a_run_that_never_goes_quiet_goes_all_the_same(clock: Clock) -> None:
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    tag = 0
    while not channel.acks:  # one arriving and finishing every half LINGER_S
        tag += 1
        assert tag * LINGER_S / 2 <= STRAGGLER_S + 2 * LINGER_S, "no frame within STRAGGLER_S"
        settler.received(tag)
        settler.done(tag)
        await clock.advance(LINGER_S / 2)
    # It went after STRAGGLER_S (the channel never went quiet), acking every delivery so far.
    assert tag * LINGER_S / 2 >= STRAGGLER_S - LINGER_S
    assert channel.acks == [(tag, True)]


async def test_a_full_run_goes_at_once(clock: Clock) -> None:
    channel = Channel()
    settler = Settler(channel, 10)  # type: ignore[arg-type]
    for tag in range(1, 26):
        settler.received(tag)
        settler.done(tag)
    await spin(clock)
    assert channel.acks[:2] == [(10, True), (20, True)]
    assert acked(channel.acks) == set(range(1, 26))


async def test_an_open_delivery_ends_the_run_and_is_never_covered(clock: Clock) -> None:
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
    for tag in (1, 2, 3, 5, 6, 7):  # 4 still runs
        settler.done(tag)
    await spin(clock)
    assert channel.acks == [(3, True)]
    # Behind 4, 5-7 wait a moment for it; it finishing in that moment makes them one run.
    settler.done(4)
    await spin(clock)
    assert channel.acks == [(3, True), (7, True)]


async def test_done_deliveries_stuck_behind_a_held_one_are_acked_alone_soon(
    clock: Clock,
) -> None:
    """A copy waiting for its confirm (its parking queue missing) holds its delivery open for
    minutes; the done ones behind it must not hold their prefetch slots meanwhile, even when
    nothing else happens on the channel (a worker whose every slot is taken)."""
    channel = Channel()
    settler = Settler(channel, 1000)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
    for tag in (1, 2, 3, 5, 6, 7):  # 4 is held
        settler.done(tag)
    await spin(clock)
    assert channel.acks == [(3, True)]
    await clock.advance(STRAGGLER_S * 3)
    assert acked(channel.acks) == {1, 2, 3, 5, 6, 7}
    assert channel.acks[1:] == [(5, False), (6, False), (7, False)]
    settler.done(4)
    settler.done(8)
    await settler.flush()
    assert channel.acks[-1] == (8, True)  # 4 and 8, the rest skipped: acked already
    assert acked(channel.acks) == set(range(1, 9))


async def test_deliveries_settled_otherwise_are_skipped_never_acked(clock: Clock) -> None:
    channel, _ = await settle(clock, 100, list(range(1, 6)), [1, 2, 4, 5], elsewhere=[3])
    assert channel.acks == [(5, True)]  # 3 was nacked: covered by nothing but its own nack
    channel, _ = await settle(clock, 100, list(range(1, 6)), [1, 2, 3], elsewhere=[4, 5])
    assert channel.acks == [(3, True)]  # the top tag of a multiple ack is one still unacked


async def test_never_more_than_one_run_is_done_and_unacked(clock: Clock) -> None:
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
            await spin(clock)
    assert worst <= 20
    await settler.flush()
    assert 1 not in acked(channel.acks)


async def test_nothing_is_sent_on_a_closed_channel(clock: Clock) -> None:
    channel = Channel()
    settler = Settler(channel, 5)  # type: ignore[arg-type]
    settler.received(1)
    channel.is_closed = True
    settler.done(1)
    await settler.flush()
    assert channel.acks == []




async def test_ack_frames_reach_the_channel_in_the_order_they_were_decided(clock: Clock) -> None:
    """aiormq's write queue is bounded: frames of separate tasks can overtake each other, and a
    ``multiple`` ack overtaken by a later one names a tag the broker no longer holds (it closes
    the channel: seen on 4.3). One writer hands them over in order."""

    class Slow(Channel):
        async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
            if not self.acks and tag == 5:  # the first frame waits for room in the queue
                for _ in range(10):
                    await asyncio.sleep(0)
            self.acks.append((tag, multiple))

    channel = Slow()
    settler = Settler(channel, 5)  # type: ignore[arg-type]
    for tag in range(1, 11):
        settler.received(tag)
        settler.done(tag)
    await settler.flush()
    assert channel.acks == [(5, True), (10, True)]

