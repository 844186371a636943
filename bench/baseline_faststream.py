"""Peer: FastStream's RabbitMQ broker with the retry queues declared by hand, as one process.

    python -m bench.baseline_faststream --url URL --queue Q --prefetch 50 --delay-ms 1000

FastStream has no retry tiers of its own; a user wires them with queue arguments: the main queue
dead-letters to ``Q.wait``, whose ``x-message-ttl`` dead-letters back to ``Q``. The subscriber
uses ``AckPolicy.REJECT_ON_ERROR``: an exception rejects the message without requeue, so the
broker moves it to ``Q.wait``. Per-message INFO logs go to a logger set to WARNING, so the
figures measure the library, not the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--prefetch", type=int, default=50)
    parser.add_argument("--delay-ms", type=int, required=True)
    parser.add_argument("--queue-type", choices=("classic", "quorum"), default="classic")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.url, args.queue, args.prefetch, args.delay_ms, args.queue_type))


def _arguments(queue_type: str, **extra: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = dict(extra)
    if queue_type == "quorum":
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"
    return arguments


async def serve(url: str, queue: str, prefetch: int, delay_ms: int, queue_type: str) -> None:
    from faststream import AckPolicy
    from faststream.rabbit import Channel, QueueType, RabbitBroker, RabbitQueue

    from bench.probe import probe

    logging.basicConfig(level=logging.WARNING)
    quiet = logging.getLogger("bench.faststream")
    quiet.setLevel(logging.WARNING)
    kind = QueueType.QUORUM if queue_type == "quorum" else QueueType.CLASSIC
    broker = RabbitBroker(url, default_channel=Channel(prefetch_count=prefetch), logger=quiet)
    # The overloads want a literal queue type; the value is picked at run time.
    main_queue = RabbitQueue(  # type: ignore[call-overload]
        queue,
        queue_type=kind,
        durable=True,
        arguments=_arguments(
            queue_type,
            **{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue + ".wait"},
        ),
    )
    wait_queue = RabbitQueue(  # type: ignore[call-overload]
        queue + ".wait",
        queue_type=kind,
        durable=True,
        arguments=_arguments(
            queue_type,
            **{
                "x-message-ttl": delay_ms,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
            },
        ),
    )

    @broker.subscriber(main_queue, ack_policy=AckPolicy.REJECT_ON_ERROR)
    async def handle(body: dict[str, Any]) -> None:
        if probe().should_fail(body.get("id"), bool(body.get("fail"))):
            raise RuntimeError("bench: planned failure")
        probe().done(body.get("t"))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await broker.connect()
    await broker.declare_queue(wait_queue)
    await broker.start()
    try:
        await stop.wait()
    finally:
        await broker.stop()


if __name__ == "__main__":
    main()
