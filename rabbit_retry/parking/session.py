"""One AMQP channel over a parking queue: read messages without removing them, settle the ones
acted on, requeue the rest.

Why it is safe to look:
- ``Q.parking`` is a classic queue, or a quorum queue with a delivery limit no look reaches (see
  topology/compile.py and parking/kinds.py): reading and requeueing a message any number of
  times never drops it. A classic queue puts a requeued message back in its original position;
  a quorum queue gets them back in small ordered batches, which keeps their order too.
- Messages are taken with ``basic.get`` without auto-ack and stay unacknowledged while we hold
  them. Whatever happens to this process, the broker requeues every unsettled one when the
  channel or connection dies; on a normal exit we nack them with requeue ourselves.
- A message is acked only after its fate is settled: a replayed copy confirmed by the broker, or
  a purge the operator asked for. Killed in between, a replay leaves at most one duplicate.
- We stop after the number of messages that were ready when we started, so messages parked while
  we work are neither read twice nor deleted unseen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from aiormq.abc import AbstractChannel
from pamqp import commands as spec

from rabbit_retry.broker.connect import connect
from rabbit_retry.broker.management import Management
from rabbit_retry.broker.requeue import REQUEUE_POLL_S, REQUEUE_WAIT_S, requeue_batches
from rabbit_retry.contract import (
    PROPERTY_NAMES,
    RETURN_COUNTERS,
    new_message_id,
    release_headers,
)
from rabbit_retry.errors import BrokerError, ConflictError, InputError
from rabbit_retry.parking.headers import replay_properties
from rabbit_retry.parking.kinds import peek_refusal
from rabbit_retry.parking.message import ParkedMessage
from rabbit_retry.settings import Settings, mask
from rabbit_retry.topology import naming

if TYPE_CHECKING:
    from rabbit_retry.tracing.replay import ReplayTrace

PUBLISH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Kind:
    """A queue's type and arguments, as the management API reports them."""

    type: str
    arguments: dict[str, Any]


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

    def __init__(
        self,
        channel: AbstractChannel,
        target: Target,
        ready: int,
        user: str,
        *,
        quorum: bool = False,
    ) -> None:
        self._channel = channel
        self._user = user
        self._quorum = quorum
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
            # A quorum queue counts our own looks in these; they say nothing about the message.
            headers={
                key: value
                for key, value in (properties.headers or {}).items()
                if key not in RETURN_COUNTERS
            },
            properties=properties_dict(properties),
        )
        return Taken(message, tag, properties)

    async def delete(self, taken: Taken) -> None:
        await self._channel.basic_ack(taken.delivery_tag)
        self._held.discard(taken.delivery_tag)

    async def replay(
        self, taken: Taken, *, handle_again: bool = False, trace: ReplayTrace | None = None
    ) -> None:
        """Publish the replay copy to the main queue, wait for the broker's confirm, then ack.

        ``mandatory`` makes a copy that cannot be routed (main queue deleted meanwhile) come back
        as an error instead of vanishing; the parked message then stays parked. ``trace``: the
        replay's span, which the copy carries (``rabbit_retry.tracing``).
        """
        properties = replay_properties(
            taken.properties, self._user, handle_again=handle_again,
            extra=trace.copied(taken.message.headers) if trace is not None else None)
        await self._publish_main(taken.message.body, properties, taken)
        await self.delete(taken)
        if trace is not None:
            trace.replayed()

    async def discard(self, taken: Taken) -> None:
        """Delete a parked message; one that holds its ordered key first sends the key's lane
        a release (through the main queue, as a replay goes), so the key's later messages go
        on: a discarded holder must not hold its key for ever."""
        release = release_headers(taken.message.headers)
        if release is not None:
            await self._publish_main(b"", spec.Basic.Properties(
                headers=release, delivery_mode=2, message_id=new_message_id()), taken)
        await self.delete(taken)

    async def _publish_main(
        self, body: bytes, properties: spec.Basic.Properties, taken: Taken
    ) -> None:
        """Publish to the main queue and wait for the broker's confirm; ``BrokerError`` (the
        parked message stays parked) when it does not take it."""
        try:
            await self._channel.basic_publish(
                body,
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

    async def requeue_rest(self) -> None:
        """Every message taken and not settled goes back, in its original position."""
        if self._held and not self._channel.is_closed and self._quorum:
            await self._take_the_rest()
            await self._requeue_in_order()
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


    async def _ready(self) -> int:
        ok = await self._channel.queue_declare(self.target.parking, passive=True)
        return int(ok.message_count or 0)

    async def _take_the_rest(self) -> None:
        # A quorum queue hands out what was given back before what never left, each in the
        # order it arrived there; so giving back only the head we read would move it behind
        # the rest. Taking the rest of what was there too and giving everything back in order
        # leaves the queue as it was (a stop before the end reads the whole queue).
        for _ in range(self.ready - self.taken):
            got = await self._channel.basic_get(self.target.parking, no_ack=False)
            if not isinstance(got.delivery, spec.Basic.GetOk):
                return
            assert got.delivery.delivery_tag is not None
            self._held.add(got.delivery.delivery_tag)

    async def _requeue_in_order(self) -> None:
        # A quorum queue shuffles a batch given back at once (parking/kinds.py): give them back
        # a few at a time, in the order taken, each batch once the queue shows the last one back.
        # Its ready count moves with other clients too, so a batch that never shows (a consumer
        # took them) ends the waiting and the rest goes back at once, below.
        base = await self._ready()
        returned = 0
        for batch in requeue_batches(self._held):
            for tag in batch:
                await self._channel.basic_nack(tag, requeue=True)
                self._held.discard(tag)
            returned += len(batch)
            deadline = asyncio.get_running_loop().time() + REQUEUE_WAIT_S
            while await self._ready() < base + returned:
                if asyncio.get_running_loop().time() > deadline:
                    return
                await asyncio.sleep(REQUEUE_POLL_S)


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
    kind_of: Callable[[str], Kind | None] | None = None,
) -> AsyncIterator[ParkingQueue]:
    """Connect, find the parking queue ``name`` designates, and yield it opened on a channel
    with publisher confirms; on the way out every unsettled message is requeued.

    ``kind_of`` tells a queue's type and arguments when it can (from the management API; None
    when it cannot tell): a parking queue the verbs could harm by looking is refused
    (``parking.kinds.peek_refusal``). Without the API's word the queue is taken for classic,
    which is what a parking queue is unless its file asked for quorum.
    """
    connection = await connect(settings, name="rabbit-retry parking")
    try:
        target = await locate(connection, name, settings.vhost)
        if need_main and not await _queue_exists(connection, target.main):
            raise InputError(
                f"queue {target.main!r} does not exist in vhost {settings.vhost!r}: replay would "
                "have nowhere to send the messages"
            )
        kind = kind_of(target.parking) if kind_of is not None else None
        if kind is not None:
            refusal = peek_refusal(target.parking, kind.type, kind.arguments)
            if refusal is not None:
                raise ConflictError(refusal)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        raw = await channel.get_underlay_channel()
        ok = await raw.queue_declare(target.parking, passive=True)
        parking = ParkingQueue(
            raw,
            target,
            int(ok.message_count or 0),
            settings.user,
            quorum=kind is not None and kind.type == "quorum",
        )
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


def management_kind_of(settings: Settings) -> Callable[[str], Kind | None]:
    """A queue's type and arguments as the management API reports them; None when it cannot say
    (API down, or pointed at another broker), since the AMQP side alone is enough to work safely
    on a broker that rabbit-retry provisioned."""

    def kind_of(queue: str) -> Kind | None:
        try:
            with Management.for_settings(settings, timeout=5.0) as api:
                info = api.queue(settings.vhost, queue)
        except BrokerError:
            return None
        if info is None:
            return None
        arguments = info.get("arguments")
        return Kind(
            str(info.get("type") or "classic"),
            dict(arguments) if isinstance(arguments, dict) else {},
        )

    return kind_of
