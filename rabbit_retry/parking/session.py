"""One AMQP channel over a parking queue: read messages without removing them, settle the ones
acted on, requeue the rest.

Why it is safe to look:
- ``Q.parking`` is a classic queue (see topology/compile.py): no delivery limit, so reading and
  requeueing a message any number of times never drops it, and a requeued message goes back to
  its original position, so parked order survives.
- Messages are taken with ``basic.get`` without auto-ack and stay unacknowledged while we hold
  them. Whatever happens to this process, the broker requeues every unsettled one when the
  channel or connection dies; on a normal exit we nack them with requeue ourselves.
- A message is acked only after its fate is settled: a replayed copy confirmed by the broker, or
  a purge the operator asked for. Killed in between, a replay leaves at most one duplicate.
- We stop after the number of messages that were ready when we started, so messages parked while
  we work are neither read twice nor deleted unseen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel
from pamqp import commands as spec

from rabbit_retry.broker.connect import connect
from rabbit_retry.broker.management import Management
from rabbit_retry.contract import PROPERTY_NAMES, republish_properties
from rabbit_retry.errors import BrokerError, ConflictError, InputError
from rabbit_retry.parking.headers import replay_headers
from rabbit_retry.parking.message import ParkedMessage
from rabbit_retry.settings import Settings, mask
from rabbit_retry.topology import naming

PUBLISH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Target:
    """The main queue and its parking queue, whichever of the two the user named."""

    main: str
    parking: str


def candidates(name: str) -> list[Target]:
    """What ``name`` may mean, in the order to try: a main queue first (``Q`` -> ``Q.parking``),
    then, for a name ending in ``.parking``, the parking queue itself. A main queue that is
    itself named ``x.parking`` therefore still resolves to ``x.parking.parking``."""
    options = [Target(name, naming.parking_queue(name))]
    main = naming.main_queue_of_parking(name)
    if main is not None:
        options.append(Target(main, name))
    return options


@dataclass(frozen=True)
class Taken:
    message: ParkedMessage
    delivery_tag: int
    properties: spec.Basic.Properties


def properties_dict(properties: spec.Basic.Properties) -> dict[str, Any]:
    return {
        name: value
        for name in PROPERTY_NAMES
        if (value := getattr(properties, name, None)) is not None
    }


class ParkingQueue:
    """A parking queue opened for one verb; use through ``open_parking``."""

    def __init__(self, channel: AbstractChannel, target: Target, ready: int, user: str) -> None:
        self._channel = channel
        self._user = user
        self.target = target
        self.ready = ready  # messages ready when we opened it: the most we will ever read
        self.taken = 0
        self._held: set[int] = set()

    async def take(self) -> Taken | None:
        """The next parked message, unacknowledged; None at the end of what was there."""
        if self.taken >= self.ready:
            return None
        got = await self._channel.basic_get(self.target.parking, no_ack=False)
        if not isinstance(got.delivery, spec.Basic.GetOk):
            return None
        tag = got.delivery.delivery_tag
        assert tag is not None
        self.taken += 1
        self._held.add(tag)
        properties = got.header.properties
        message = ParkedMessage(
            position=self.taken,
            body=got.body,
            headers=dict(properties.headers or {}),
            properties=properties_dict(properties),
        )
        return Taken(message, tag, properties)

    async def delete(self, taken: Taken) -> None:
        await self._channel.basic_ack(taken.delivery_tag)
        self._held.discard(taken.delivery_tag)

    async def replay(self, taken: Taken, *, handle_again: bool = False) -> None:
        """Publish the replay copy to the main queue, wait for the broker's confirm, then ack.

        ``mandatory`` makes a copy that cannot be routed (main queue deleted meanwhile) come back
        as an error instead of vanishing; the parked message then stays parked.
        """
        properties = republish_properties(
            taken.properties,
            replay_headers(taken.message.headers, handle_again=handle_again),
            self._user,
        )
        try:
            await self._channel.basic_publish(
                taken.message.body,
                exchange="",
                routing_key=self.target.main,
                properties=properties,
                mandatory=True,
                timeout=PUBLISH_TIMEOUT_S,
            )
        except aiormq.exceptions.PublishError as exc:
            raise BrokerError(
                f"the broker returned the copy of parked message #{taken.message.position}: "
                f"queue {self.target.main!r} did not accept it ({_reply_text(exc)}); "
                "it stays parked"
            ) from None
        except aiormq.exceptions.DeliveryError:
            raise BrokerError(
                f"the broker refused the copy of parked message #{taken.message.position} "
                f"(publisher nack; is {self.target.main!r} full?); it stays parked"
            ) from None
        except TimeoutError:
            raise BrokerError(
                f"no publisher confirm for the copy of parked message #{taken.message.position} "
                f"within {PUBLISH_TIMEOUT_S:.0f}s; it stays parked (the copy may still arrive)"
            ) from None
        await self.delete(taken)

    async def requeue_rest(self) -> None:
        """Every message taken and not settled goes back, in its original position."""
        if self._held and not self._channel.is_closed:
            # The broker refuses a nack naming a tag already acked, even with multiple=True:
            # name the highest tag still held, which covers every held one below it.
            await self._channel.basic_nack(max(self._held), multiple=True, requeue=True)
            self._held.clear()
            # A nack has no answer; the broker hands it to the queue and we could leave before
            # the queue took them back, and a verb run right after would miss them. A passive
            # declare on the same channel reaches the queue after the nack, so once it answers
            # they are all back.
            await self._channel.queue_declare(self.target.parking, passive=True)


def _reply_text(exc: aiormq.exceptions.PublishError) -> str:
    frame = exc.frame
    if isinstance(frame, spec.Basic.Return):
        return f"{frame.reply_code} {frame.reply_text}"
    return "returned"


async def _queue_exists(connection: AbstractConnection, queue: str) -> bool:
    """Whether the broker has ``queue`` (a passive declare, on a channel of its own)."""
    channel = await connection.channel(publisher_confirms=False)
    raw = await channel.get_underlay_channel()
    try:
        await raw.queue_declare(queue, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        with suppress(Exception):
            await channel.close()
    return True


async def locate(connection: AbstractConnection, name: str, vhost: str) -> Target:
    """The target ``name`` designates on the broker; ``InputError`` when no queue fits."""
    for target in candidates(name):
        if await _queue_exists(connection, target.parking):
            return target
    if naming.main_queue_of_parking(name) is not None:
        raise InputError(f"queue {name!r} does not exist in vhost {vhost!r}")
    raise InputError(
        f"queue {naming.parking_queue(name)!r} does not exist in vhost {vhost!r}: is {name!r} a "
        "queue of a topology applied to this vhost?"
    )


@asynccontextmanager
async def open_parking(
    settings: Settings,
    name: str,
    *,
    need_main: bool = False,
    type_of: Callable[[str], str | None] | None = None,
) -> AsyncIterator[ParkingQueue]:
    """Connect, find the parking queue ``name`` designates, and yield it opened on a channel
    with publisher confirms; on the way out every unsettled message is requeued.

    ``type_of`` tells a queue's type when it can (from the management API; None when it cannot
    tell): a parking queue that is not classic is refused, since a quorum queue's delivery limit
    could drop a message we only meant to look at, and its requeues do not keep order.
    """
    connection = await connect(settings, name="rabbit-retry parking")
    try:
        target = await locate(connection, name, settings.vhost)
        if need_main and not await _queue_exists(connection, target.main):
            raise InputError(
                f"queue {target.main!r} does not exist in vhost {settings.vhost!r}: replay would "
                "have nowhere to send the messages"
            )
        queue_type = type_of(target.parking) if type_of is not None else None
        if queue_type is not None and queue_type != "classic":
            raise ConflictError(
                f"{target.parking!r} is a {queue_type} queue; rabbit-retry only reads classic "
                "parking queues, where looking at a message can never drop or reorder it"
            )
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        raw = await channel.get_underlay_channel()
        ok = await raw.queue_declare(target.parking, passive=True)
        parking = ParkingQueue(raw, target, int(ok.message_count or 0), settings.user)
        try:
            yield parking
        finally:
            with suppress(aiormq.exceptions.AMQPError, RuntimeError):
                # if this fails, closing the connection below requeues them all the same
                await parking.requeue_rest()
    except aiormq.exceptions.AMQPError as exc:
        raise BrokerError(f"broker at {settings.safe_url} failed: {mask(str(exc))}") from exc
    finally:
        with suppress(Exception):
            await connection.close()


def management_type_of(settings: Settings) -> Callable[[str], str | None]:
    """A queue's type as the management API reports it; None when it cannot say (API down, or
    pointed at another broker), since the AMQP side alone is enough to work safely on a broker
    that rabbit-retry provisioned."""

    def type_of(queue: str) -> str | None:
        try:
            with Management.for_settings(settings, timeout=5.0) as api:
                info = api.queue(settings.vhost, queue)
        except BrokerError:
            return None
        if info is None:
            return None
        return str(info.get("type") or "classic")

    return type_of
