"""Peer: Dramatiq with its RabbitMQ broker and its Retries middleware, as one worker process.

    python -m bench.baseline_dramatiq --url URL --queue Q --prefetch 50 --backoff-ms 1000

How Dramatiq delays a retry (dramatiq 2.x, ``brokers/rabbitmq.py``, ``middleware/retries.py``,
``worker.py``): after a failure the Retries middleware calls ``broker.enqueue(message,
delay=backoff)``, which publishes a copy, with an ``eta`` option in the message, to the queue
``Q.DQ`` (no TTL on it). Every worker consumes ``Q.DQ`` with a prefetch of 1000 x its worker
threads (8,000 by default) and keeps each delayed message, unacked, in an in-process priority
queue until its eta passes; only then does it publish it back to ``Q`` and ack the ``Q.DQ``
copy. So up to that prefetch of waiting messages sit in the worker's memory; the rest wait,
ready, in ``Q.DQ`` on the broker. The backoff is ``min_backoff * 2**retries`` with jitter up to
twice that (capped at ``max_backoff``, then jittered between 50% and 100% of it).

With ``--exact-delay`` the actor raises ``dramatiq.Retry(delay=...)``, which the same Retries
middleware honours without jitter, so every peer waits the same time before its retry.

The harness publishes Dramatiq's own message envelope (``encode``) so that the worker sees what
``actor.send`` would have sent; the actor's fail rule and timing come from ``bench/probe.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

ACTOR = "bench_handle"


def encode(queue: str, body: dict[str, Any]) -> bytes:
    """Dramatiq's wire format for a call of the bench actor with ``body`` as its argument."""
    import dramatiq

    message: dramatiq.Message[Any] = dramatiq.Message(
        queue_name=queue, actor_name=ACTOR, args=(body,), kwargs={}, options={}
    )
    return message.encode()


def declare_queues(url: str, queue: str) -> None:
    """``Q``, ``Q.DQ`` and ``Q.XQ`` exactly as Dramatiq declares them, so that a backlog can be
    published before the worker starts."""
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=url)
    try:
        broker.declare_queue(queue, ensure=True)
    finally:
        broker.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--prefetch", type=int, default=50)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--backoff-ms", type=int, required=True, help="min_backoff = max_backoff")
    parser.add_argument("--max-backoff-ms", type=int, default=None)
    parser.add_argument(
        "--exact-delay",
        action="store_true",
        help="fail with dramatiq.Retry(delay=backoff) instead of an exception: no jitter",
    )
    args = parser.parse_args(argv)

    # Read by dramatiq.worker at import time: the same prefetch as the other consumers.
    os.environ["dramatiq_queue_prefetch"] = str(args.prefetch)  # noqa: SIM112 - its spelling
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.worker import Worker

    from bench.probe import probe

    broker = RabbitmqBroker(url=args.url)
    dramatiq.set_broker(broker)

    @dramatiq.actor(
        actor_name=ACTOR,
        queue_name=args.queue,
        max_retries=1_000,
        min_backoff=args.backoff_ms,
        max_backoff=args.max_backoff_ms or args.backoff_ms,
    )
    def bench_handle(body: dict[str, Any]) -> None:
        if probe().should_fail(body.get("id"), bool(body.get("fail"))):
            if args.exact_delay:
                raise dramatiq.Retry(delay=args.backoff_ms)
            raise RuntimeError("bench: planned failure")
        probe().done(body.get("t"))

    worker = Worker(broker, worker_threads=args.threads)
    worker.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    worker.stop(timeout=5_000)
    broker.close()


if __name__ == "__main__":
    main()
