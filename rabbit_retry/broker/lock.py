"""One ``apply`` or ``migrate`` at a time on a vhost: a lock that is an exclusive queue.

The lock is the queue ``rabbit-retry.lock``, declared exclusive on a connection of its own that
lives as long as the run. The broker lets one connection at a time hold an exclusive queue and
deletes it when that connection ends, however it ends: a run killed with ``kill -9`` leaves no
stale lock. Who holds it (host, pid, verb, file, since when) is written in the queue's
arguments, which any user who may see the vhost's queues reads through the management API:
declaring a queue and reading it need no more than the ``management`` tag and the permissions
``apply`` needs anyway. The connection is held by a thread with an event loop of its own, so
the run's own work (several event loops, the management API) goes on beside it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import aiormq.exceptions

from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect
from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError, RabbitRetryError
from rabbit_retry.settings import Settings, mask
from rabbit_retry.topology.naming import LOCK_QUEUE

# How often a waiting run tries again; the broker frees the lock the moment its holder's
# connection ends, so this is only how soon the next one notices.
RETRY_SECONDS = 0.5
_FIELDS = ("verb", "file", "host", "pid", "since")


def holder_arguments(verb: str, file: str) -> dict[str, Any]:
    """What the lock queue says about this run (its arguments)."""
    return {
        "rabbit-retry-verb": verb,
        "rabbit-retry-file": file,
        "rabbit-retry-host": socket.gethostname(),
        "rabbit-retry-pid": os.getpid(),
        "rabbit-retry-since": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def describe_holder(arguments: dict[str, Any] | None) -> str:
    """``apply of orders.yml on host ci-7, pid 4121, since 2026-11-27T23:10:04Z``."""
    if not arguments:
        return "another run (it is gone, or did not say who it is)"
    found = {k: arguments.get(f"rabbit-retry-{k}") for k in _FIELDS}
    if not any(found.values()):
        return "a queue named rabbit-retry.lock that rabbit-retry did not make"
    return (f"{found['verb'] or 'a run'} of {found['file'] or '?'} on host "
            f"{found['host'] or '?'}, pid {found['pid'] or '?'}, since {found['since'] or '?'}")


class LockHeld(RabbitRetryError):
    """Another run holds the vhost's lock (exit 1: try again later)."""


class VhostLock:
    """``with VhostLock(settings, "apply", file, timeout, say):`` holds the lock of
    ``settings.vhost`` for the block; waits up to ``timeout`` seconds (0: not at all) for
    another run to finish, telling ``say`` once who it waits for; raises ``LockHeld`` naming
    the holder when it does not get it."""

    def __init__(self, settings: Settings, verb: str, file: str, timeout: float,
                 say: Callable[[str], None]) -> None:
        self._settings = settings
        self._arguments = holder_arguments(verb, file)
        self._timeout = timeout
        self._say = say
        self._acquired = threading.Event()
        self._release = threading.Event()
        self._lost = threading.Event()  # the lock's connection ended while the run held it
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rabbit-retry lock", daemon=True)

    def __enter__(self) -> VhostLock:
        self._thread.start()
        self._acquired.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._release.set()
        self._thread.join()

    def check(self) -> None:
        """Raise ``BrokerError`` when the lock's connection has ended (the broker restarted,
        the network dropped it, an operator closed it): from then on another run may hold the
        lock, so the run stops before its next change."""
        if self._lost.is_set() and not self._release.is_set():
            raise BrokerError(
                f"lost the lock of vhost {self._settings.vhost!r}: its connection to the broker "
                f"closed; stopped before the next change (run it again to finish)"
            )

    def _run(self) -> None:
        try:
            asyncio.run(self._hold())
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc
        finally:
            self._acquired.set()

    async def _hold(self) -> None:
        me = self._arguments
        name = (f"rabbit-retry {me['rabbit-retry-verb']} (lock) on {me['rabbit-retry-host']}, "
                f"pid {me['rabbit-retry-pid']}")
        connection = await connect(self._settings, name=name)
        try:
            deadline = time.monotonic() + self._timeout
            told = False
            while True:
                channel = await connection.channel(publisher_confirms=False)
                try:
                    await channel.declare_queue(LOCK_QUEUE, exclusive=True, durable=False,
                                                arguments=self._arguments)
                    break
                except (aiormq.exceptions.ChannelLockedResource,
                        aiormq.exceptions.ChannelPreconditionFailed):
                    pass
                except CONNECTION_ERRORS as exc:
                    raise BrokerError(f"taking the lock of vhost {self._settings.vhost!r} "
                                      f"failed: {mask(str(exc))}") from exc
                holder = await asyncio.to_thread(self._holder)
                if time.monotonic() >= deadline:
                    raise LockHeld(
                        f"vhost {self._settings.vhost!r} is locked by {holder}; nothing was "
                        f"changed; wait for it to finish (--lock-timeout SECONDS waits)"
                    )
                if not told:
                    self._say(f"waiting up to {self._timeout:g}s for the lock of vhost "
                              f"{self._settings.vhost!r}, held by {holder}")
                    told = True
                await asyncio.sleep(RETRY_SECONDS)
            connection.close_callbacks.add(lambda *_: self._lost.set())
            self._acquired.set()
            await asyncio.to_thread(self._release.wait)
            if not self._lost.is_set():
                # Deleted before the run ends, not when the broker gets round to the closed
                # connection's exclusive queue: whatever comes next sees the lock free.
                with suppress(*CONNECTION_ERRORS, aiormq.exceptions.AMQPError):
                    await channel.queue_delete(LOCK_QUEUE)
        finally:
            await connection.close()

    def _holder(self) -> str:
        try:
            with Management.for_settings(self._settings) as api:
                queue = api.queue(self._settings.vhost, LOCK_QUEUE)
        except BrokerError as exc:  # a user who may not read it still learns it is held
            return f"another run (who could not be read: {mask(str(exc))})"
        arguments = queue.get("arguments") if isinstance(queue, dict) else None
        return describe_holder(arguments if isinstance(arguments, dict) else None)
