"""Exact message counts, read over AMQP: a passive declare answers with the queue's ready
messages and consumers as the broker counts them this moment, where the management API's
statistics lag by seconds (a message parked a second ago would not show yet)."""

from __future__ import annotations

from collections.abc import Iterable

import aiormq.exceptions

from rabbit_retry.broker.connect import connect
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings, mask

TIMEOUT = 30.0


async def ready_and_consumers(
    settings: Settings, names: Iterable[str]
) -> dict[str, tuple[int, int]]:
    """queue -> (ready messages, consumers) for each of ``names`` that exists."""
    counts: dict[str, tuple[int, int]] = {}
    connection = await connect(settings, name="rabbit-retry counts")
    try:
        channel = await (await connection.channel(publisher_confirms=False)).get_underlay_channel()
        for name in names:
            try:
                ok = await channel.queue_declare(name, passive=True, timeout=TIMEOUT)
            except aiormq.exceptions.ChannelNotFoundEntity:  # deleted meanwhile
                channel = await (
                    await connection.channel(publisher_confirms=False)
                ).get_underlay_channel()
                continue
            except aiormq.exceptions.ChannelAccessRefused as exc:
                # The broker names configure access; any permission on the queue admits it.
                raise BrokerError(
                    f"counting the messages of queue {name!r} was refused ({mask(str(exc))}): "
                    f"user {settings.user!r} needs a permission on the file's queues "
                    "(read is enough)"
                ) from exc
            counts[name] = (int(ok.message_count or 0), int(ok.consumer_count or 0))
    finally:
        await connection.close()
    return counts
