"""Benchmark 8, ``rabbit-retry migrate`` of a classic queue of N messages to quorum, against a
bare shovel-style move on the same broker.

Ours is ``rabbit_retry.broker.migrate.migrate`` (what ``rabbit-retry migrate FILE --yes`` runs
after reading the plan), called in the harness process: it moves every message twice (into the
holding queue, then into the new queue), consuming with a window of unacked messages and
publishing the copies in batches, each original acked once its copy is confirmed, and looks at
each destination first. The baseline moves the messages once, as a shovel in
``on-confirm`` mode does: consume with a prefetch window, publish each copy to a new quorum
queue, ack the original when the copy is confirmed. Both figures are messages of the original
queue per second of the whole operation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aio_pika
from support.amqp import blocking, depth_sync, publish_stream_sync
from support.poll import wait_for
from support.provision import provision_sync

from bench import common
from rabbit_retry.broker.diff import diff
from rabbit_retry.broker.inspect import read_live
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.topology import compile_topology, parse_topology

QUEUE = "bench.migrate"
OURS = "rabbit-retry migrate"
BARE = "bare shovel-style move"


def _topology(queue_type: str) -> str:
    return common.queue_topology(QUEUE, delays=["1m"], max_attempts=5, queue_type=queue_type)


def message(i: int) -> aio_pika.Message:
    return common.json_message({"id": i, "order": f"o-{i:06d}", "amount": i % 1000},
                               message_id=str(i))


async def ours(settings: Settings) -> None:
    from rabbit_retry.broker.migrate import migrate
    from rabbit_retry.broker.migrate_plan import plan_migrations

    plan = compile_topology(parse_topology(_topology("quorum"), "bench.yml"))
    with Management.for_settings(settings) as api:
        live = read_live(api, settings.vhost)
    migrations = [m for m in plan_migrations(diff(plan, live), live, plan.bindings)
                  if m.name == QUEUE]
    assert migrations, "nothing to migrate"
    await migrate(settings, migrations)


async def bare_move(settings: Settings, source: str, target: str, *, prefetch: int) -> None:
    """Consume ``source`` with ``prefetch`` in flight, publish each copy to a new quorum
    ``target`` (mandatory, confirmed), ack the original once its copy is confirmed."""
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=prefetch)
        await channel.declare_queue(target, durable=True, arguments={"x-queue-type": "quorum"})
        queue = await channel.get_queue(source, ensure=False)
        left = (await channel.declare_queue(source, passive=True)).declaration_result
        total = int(left.message_count or 0)
        done = asyncio.Event()
        moved = 0
        exchange = channel.default_exchange

        async def move(incoming: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal moved
            copy = aio_pika.Message(
                incoming.body, headers=incoming.headers, content_type=incoming.content_type,
                message_id=incoming.message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await exchange.publish(copy, target, mandatory=True)
            await incoming.ack()
            moved += 1
            if moved >= total:
                done.set()

        if total:
            tag = await queue.consume(move)
            await done.wait()
            await queue.cancel(tag)


def run(
    settings: Settings,
    *,
    n: int = 10_000,
    runs: int = 3,
    prefetch: int = 200,
    timeout: float = 600.0,
    log: Callable[[str], None] = common.say,
) -> dict[str, Any]:
    def measure(tag: str, move: Callable[[Settings], Any], where: str) -> float:
        with common.throwaway_vhost(settings, tag) as s:
            provision_sync(s, _topology("classic"))
            publish_stream_sync(s, QUEUE, n, message)
            start = time.perf_counter()
            blocking(move(s), timeout)
            seconds = time.perf_counter() - start
            wait_for(lambda: depth_sync(s, where) == n, f"{n} messages in {where}", within=30,
                     interval=0.5)
        return n / seconds

    systems: dict[str, Callable[[], float]] = {
        OURS: lambda: measure("migrate-ours", ours, QUEUE),
        BARE: lambda: measure(
            "migrate-bare", lambda s: bare_move(s, QUEUE, f"{QUEUE}.new", prefetch=prefetch),
            f"{QUEUE}.new",
        ),
    }
    log(f"migrate: {n:,} messages x {runs} runs")
    samples = common.alternate(runs, systems, log=log)
    return common.throughput_result(
        "migrate: a classic queue of messages rebuilt as quorum",
        samples,
        ours=OURS,
        baseline=BARE,
        unit="msg/s",
        goal=None,
        notes=[
            f"{n:,} persistent JSON messages in a classic `{QUEUE}` with its tier and parking "
            "queue; ours rebuilds it (and its tier) as quorum with `rabbit-retry migrate`: "
            "every message moved twice (into `" + QUEUE + ".migrating` and back), each move "
            "consuming with a window of 1,000 unacked (after a first round of 100 that tells "
            "the message size) and publishing the copies in batches, "
            "each original acked once its copy is confirmed, bindings switched, the old queue "
            "deleted once empty; median of alternating runs; afterwards the harness counts the "
            "messages in the new queue.",
            f"Baseline: one move into a new quorum queue, consuming with prefetch {prefetch} "
            "and acking each message after its copy's confirm (a shovel's `on-confirm`), "
            "nothing else (no bindings, no deletion, no look at the destination).",
        ],
        params={"n": n, "runs": runs, "prefetch": prefetch},
    )
