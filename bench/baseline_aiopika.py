"""Baselines written with bare aio-pika: a consume-and-ack loop, and a retry loop that does
nack -> TTL queue -> back by hand. Each runs as its own process:

    python -m bench.baseline_aiopika ack   --url URL --queue Q --prefetch 50
    python -m bench.baseline_aiopika retry --url URL --queue Q --prefetch 50

The probe (``bench/probe.py``, configured from the environment) records the first delivery and
the N-th completion. ``declare_retry_by_hand`` declares the queues the retry loop needs, as a
user without rabbit-retry would: the main queue dead-letters to a wait queue whose TTL
dead-letters back to the main queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from bench.probe import probe

STYLES = ("iterator", "callback")


def wait_queue(queue: str) -> str:
    return queue + ".wait"


def _type_arguments(queue_type: str) -> dict[str, Any]:
    arguments: dict[str, Any] = {"x-queue-type": queue_type}
    if queue_type == "quorum":
        # The same safety rabbit-retry's tiers get: at-least-once dead-lettering.
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"
    return arguments


async def declare_retry_by_hand(url: str, queue: str, delay_ms: int, queue_type: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(
            queue,
            durable=True,
            arguments={
                **_type_arguments(queue_type),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": wait_queue(queue),
            },
        )
        await channel.declare_queue(
            wait_queue(queue),
            durable=True,
            arguments={
                **_type_arguments(queue_type),
                "x-message-ttl": delay_ms,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
            },
        )


async def declare_plain(url: str, queue: str, queue_type: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=_type_arguments(queue_type))


async def _handle_ack(message: AbstractIncomingMessage) -> None:
    probe().done()
    await message.ack()


async def _handle_retry(message: AbstractIncomingMessage) -> None:
    # By hand: a message that has not been dead-lettered yet fails once; the broker's x-death
    # header is how a bare loop knows it came back.
    if not message.headers.get("x-death"):
        await message.nack(requeue=False)
        return
    probe().done()
    await message.ack()


async def consume(url: str, queue_name: str, prefetch: int, mode: str, style: str) -> None:
    """Consumes until cancelled (SIGTERM cancels the main task)."""
    handle = _handle_ack if mode == "ack" else _handle_retry
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.get_queue(queue_name, ensure=False)
        if style == "callback":
            # aiormq runs each delivery's callback as its own task: concurrency up to prefetch.
            await queue.consume(handle)
            await asyncio.Future()
        async with queue.iterator() as messages:
            async for message in messages:
                await handle(message)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("ack", "retry"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--prefetch", type=int, default=50)
    parser.add_argument("--style", choices=STYLES, default="iterator")
    args = parser.parse_args(argv)
    run_until_signal(consume(args.url, args.queue, args.prefetch, args.mode, args.style))


def run_until_signal(coro: Coroutine[Any, Any, None]) -> None:
    """Runs ``coro`` until it ends or SIGTERM/SIGINT cancels it; exits quietly either way."""

    async def runner() -> None:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(runner())


if __name__ == "__main__":
    main()
