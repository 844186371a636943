"""Benchmark 5b, ``parking replay`` of N parked messages against a bare confirmed-publish loop.

Both move every message of ``Q.parking`` back to ``Q`` with the same safety: take one parked
message (``basic.get``, unacked), publish its copy to ``Q`` with ``mandatory`` and wait for the
publisher confirm, then ack the parked one. Ours is ``rabbit_retry.parking.act.replay`` (what
``rabbit-retry parking replay Q --yes`` runs), called in the harness process so the figure
excludes interpreter start-up; the baseline is the same loop in bare aio-pika. A third row, for
reference and not part of the ratio, pipelines the baseline (a window of copies in flight,
each parked message acked after its copy's confirm): what the broker allows when the loop does
not wait for one confirm at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aio_pika
from support.amqp import blocking, depth_sync, publish_stream_sync
from support.poll import wait_for
from support.provision import provision_sync

from bench import common
from bench.probe import QUEUE
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming

OURS = "rabbit-retry parking replay"
BARE = "bare confirmed-publish loop"
PIPELINED = "bare, pipelined (reference)"
PARKING_HEADERS = (
    "parked-reason",
    "parked-at",
    "exception-type",
    "exception-message",
    "exception-stacktrace",
    "original-exchange",
    "original-routing-key",
    "original-queue",
)
STACK = "Traceback (most recent call last):\n" + '  File "app.py", line 1, in handle\n' * 24


def parked_message(i: int) -> aio_pika.Message:
    """A message as the worker parks it: body, properties and the parking headers."""
    return common.json_message(
        {"id": i, "order": f"o-{i:06d}", "amount": i % 1000},
        message_id=str(i),
        headers={
            "parked-reason": "exhausted",
            "parked-at": datetime.now(UTC).isoformat(),
            "retry-count": 5,
            "exception-type": "TimeoutError",
            "exception-message": "upstream did not answer in 30s",
            "exception-stacktrace": STACK,
            "original-exchange": "orders",
            "original-routing-key": "order.created",
            "original-queue": QUEUE,
        },
    )


def run(
    settings: Settings,
    *,
    n: int = 10_000,
    runs: int = 3,
    queue_type: str = "quorum",
    window: int = 100,
    pipelined: bool = True,
    timeout: float = 300.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    topology = common.queue_topology(QUEUE, delays=["1m"], max_attempts=5, queue_type=queue_type)
    parking = naming.parking_queue(QUEUE)

    def measure(tag: str, replay: Callable[[Settings], Any]) -> float:
        with common.throwaway_vhost(settings, tag) as s:
            provision_sync(s, topology)
            publish_stream_sync(s, parking, n, parked_message)
            start = time.perf_counter()
            blocking(replay(s), timeout)
            seconds = time.perf_counter() - start
            _check_moved(s, parking, n)
        return n / seconds

    def ours() -> float:
        from rabbit_retry.parking import act, filters

        return measure("replay-ours", lambda s: act.replay(s, QUEUE, filters.Selection()))

    systems: dict[str, Callable[[], float]] = {
        BARE: lambda: measure("replay-bare", lambda s: bare_replay(s, parking, QUEUE, window=1)),
    }
    notes = [
        f"{n:,} persistent parked messages (JSON body, parking headers with a 1 KB stack trace) "
        f"in a classic `{parking}`, replayed to a {queue_type} `{QUEUE}`; median of {runs} "
        "alternating runs; afterwards the harness counts the messages in both queues (nothing "
        "lost).",
    ]
    if _parking_available():
        systems = {OURS: ours, **systems}
    else:
        notes.append("rabbit-retry parking replay: not available in this tree yet.")
    if pipelined:
        systems[PIPELINED] = lambda: measure(
            "replay-pipelined", lambda s: bare_replay(s, parking, QUEUE, window=window)
        )
        notes.append(f"Pipelined reference: {window} copies in flight.")
    log(f"parking replay: {n:,} messages x {runs} runs")
    samples = common.alternate(runs, systems, log=log)
    outcome = common.throughput_result(
        "Parking replay: parked messages back to their queue",
        samples,
        ours=OURS,
        baseline=BARE,
        unit="msg/s",
        goal=None,
        notes=notes,
        params={"n": n, "runs": runs, "queue_type": queue_type, "window": window},
    )
    return outcome


def _parking_available() -> bool:
    try:
        from rabbit_retry.parking import act, filters
    except ImportError:
        return False
    return hasattr(act, "replay") and hasattr(filters, "Selection")


def _check_moved(settings: Settings, parking: str, n: int) -> None:
    def moved() -> bool:
        return depth_sync(settings, QUEUE) == n and depth_sync(settings, parking) == 0

    wait_for(moved, f"{n} messages moved from {parking} to {QUEUE}", within=30, interval=0.5)


async def bare_replay(settings: Settings, parking: str, queue: str, *, window: int) -> None:
    """The by-hand loop: get, publish the copy (parking headers stripped, replay-count + 1) with
    confirm and ``mandatory``, ack the original; ``window`` copies in flight at most."""
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        source = await channel.get_queue(parking, ensure=False)
        exchange = channel.default_exchange
        pending: set[asyncio.Task[None]] = set()

        async def move(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            headers = {
                k: v
                for k, v in (message.headers or {}).items()
                if k not in PARKING_HEADERS and not k.startswith("x-")
            }
            headers["retry-count"] = 0
            headers["replay-count"] = int(str(headers.get("replay-count", 0))) + 1
            copy = aio_pika.Message(
                message.body,
                headers=headers,
                content_type=message.content_type,
                message_id=message.message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await exchange.publish(copy, queue, mandatory=True)
            await message.ack()

        while True:
            message = await source.get(no_ack=False, fail=False)
            if message is None:
                break
            if window <= 1:
                await move(message)
                continue
            task = asyncio.ensure_future(move(message))
            pending.add(task)
            task.add_done_callback(pending.discard)
            if len(pending) >= window:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            await asyncio.gather(*pending)
