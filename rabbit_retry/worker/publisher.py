"""Confirmed, mandatory publishing of retry and parked copies, and holding a delivery until one
of them is confirmed.

A copy counts as published only when the broker confirmed it (``basic.ack``) and did not return
it as unroutable (``basic.return``); anything else (return, ``basic.nack``, no confirm in time, a
closed channel) is a failed publish. A failed publish never acks the original: the delivery is
held and the publish retried with capped exponential backoff; if the consuming channel dies in
the meantime the held delivery has gone back to the broker and is simply forgotten.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiormq
import aiormq.exceptions
from aiormq import spec
from aiormq.abc import AbstractChannel, AbstractConnection

from rabbit_retry.backoff import Backoff
from rabbit_retry.broker.connect import CONNECTION_ERRORS

log = logging.getLogger("rabbit_retry.worker")

CONFIRM_TIMEOUT = 30.0
BACKOFF_INITIAL = 0.2
BACKOFF_MAX = 30.0


class PublishFailed(Exception):
    """The broker did not take responsibility for a copy."""


class Unroutable(PublishFailed):
    """The broker returned the copy: nothing is bound where it was sent."""


class DeliveryGone(Exception):
    """The channel the delivery came on closed: the broker has already requeued it."""


class Publisher:
    """One confirming channel per connection, reopened when the broker closes it.

    aiormq matches a ``basic.return`` to its publish by ``message_id``; two copies with the same
    id in flight on one channel could have a return credited to the wrong one, reporting an
    unroutable copy as delivered. Publishes that share a message id therefore go one at a time.
    """

    def __init__(self, connection: AbstractConnection, timeout: float = CONFIRM_TIMEOUT) -> None:
        self._connection = connection
        self._timeout = timeout
        self._channel: AbstractChannel | None = None
        self._open_lock = asyncio.Lock()
        self._id_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        # Destinations currently failing -> failed attempts, to log once per streak.
        self._failing: dict[tuple[str, str], int] = {}

    async def _get_channel(self) -> AbstractChannel:
        async with self._open_lock:
            if self._channel is None or self._channel.is_closed:
                try:
                    self._channel = await self._connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
                except CONNECTION_ERRORS as exc:
                    raise PublishFailed(f"cannot open a publishing channel: {exc}") from exc
            return self._channel

    @asynccontextmanager
    async def _one_at_a_time(self, message_id: str) -> AsyncIterator[None]:
        lock, users = self._id_locks.get(message_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._id_locks[message_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._id_locks[message_id]
            if users <= 1:
                del self._id_locks[message_id]
            else:
                self._id_locks[message_id] = (lock, users - 1)

    async def publish(
        self, exchange: str, routing_key: str, body: bytes, properties: spec.Basic.Properties
    ) -> None:
        """Publish once; return when confirmed, raise ``PublishFailed`` otherwise."""
        message_id = properties.message_id
        assert message_id, "copies always carry a message_id"
        where = f"exchange {exchange or '(default)'!r} with routing key {routing_key!r}"
        async with self._one_at_a_time(message_id):
            channel = await self._get_channel()
            try:
                result = await channel.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=True,
                    timeout=self._timeout,
                )
            except aiormq.exceptions.PublishError as exc:
                raise Unroutable(f"unroutable: nothing bound to {where}") from exc
            except aiormq.exceptions.DeliveryError as exc:
                raise PublishFailed(f"the broker refused the copy sent to {where}") from exc
            except TimeoutError as exc:
                raise PublishFailed(
                    f"no publisher confirm within {self._timeout:g}s for {where}"
                ) from exc
            except aiormq.exceptions.ChannelNotFoundEntity as exc:
                raise PublishFailed(f"{where}: {exc}") from exc
            except CONNECTION_ERRORS as exc:
                raise PublishFailed(f"publishing to {where} failed: {exc!r}") from exc
            if not isinstance(result, spec.Basic.Ack):
                raise PublishFailed(f"no publisher confirm for {where} (got {result!r})")

    async def publish_held(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: spec.Basic.Properties,
        *,
        delivery_alive: Callable[[], bool],
        context: dict[str, Any],
        unroutable: tuple[str, str] | None = None,
    ) -> None:
        """Publish until confirmed, backing off; ``DeliveryGone`` once the delivery is gone.
        ``unroutable``: where to send it instead (exchange, routing key) once the broker
        returns it as unroutable."""
        destination = (exchange, routing_key)
        backoff = Backoff(BACKOFF_INITIAL, BACKOFF_MAX)
        while True:
            if not delivery_alive():
                raise DeliveryGone()
            try:
                await self.publish(*destination, body, properties)
                break
            except PublishFailed as exc:
                if isinstance(exc, Unroutable) and unroutable is not None:
                    destination, unroutable = unroutable, None
                    continue
                self._note_failure(destination, exc, context)
            await backoff.wait()
        self._note_success(destination, context)

    def _note_failure(
        self, destination: tuple[str, str], exc: PublishFailed, context: dict[str, Any]
    ) -> None:
        failed = self._failing.get(destination, 0)
        self._failing[destination] = failed + 1
        if failed == 0:
            log.warning(
                "publish failed, holding the message unacked and retrying with backoff:"
                " %s (queue=%s message_id=%s)",
                exc,
                context.get("queue"),
                context.get("message_id"),
                extra={**context, "event": "publish_failed"},
            )

    def _note_success(self, destination: tuple[str, str], context: dict[str, Any]) -> None:
        failed = self._failing.pop(destination, 0)
        if failed:
            log.warning(
                "publish to exchange %r with routing key %r works again after %d failed"
                " attempt(s) (queue=%s)",
                destination[0],
                destination[1],
                failed,
                context.get("queue"),
                extra={**context, "event": "publish_recovered"},
            )

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            try:
                await channel.close()
            except Exception as exc:  # closing a dying channel is best effort
                log.debug("closing the publishing channel: %r", exc)
