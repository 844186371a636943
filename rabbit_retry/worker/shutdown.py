"""Letting in-flight handlers finish when the worker stops (SIGTERM / SIGINT).

The consumers are cancelled first, so nothing new arrives; what is running gets ``grace``
seconds, or until a second signal (``force``); a handler still running then is cancelled, and
its message sent back to its queue as a confirmed copy (``session``): the next start takes it
as a fresh delivery at full concurrency, not as a crash's return to run alone. What cannot be
sent back is not acked: the broker hands it out again when the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

log = logging.getLogger("rabbit_retry.worker")

CANCEL_TIMEOUT = 5.0  # how long a cancelled handler may take to unwind


async def finish(tasks: Collection[asyncio.Task[Any]], grace: float, force: asyncio.Event) -> None:
    """Wait up to ``grace`` seconds (or until ``force``) for ``tasks``; cancel the rest."""
    pending = {t for t in tasks if not t.done()}
    if not pending:
        return
    log.info("stopping: waiting up to %gs for %d in-flight message(s)", grace, len(pending))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    forced: asyncio.Future[Any] = asyncio.ensure_future(force.wait())
    try:
        while not forced.done():
            pending = {t for t in pending if not t.done()}
            left = deadline - loop.time()
            if not pending or left <= 0:
                break
            await asyncio.wait(
                {*pending, forced}, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
    finally:
        forced.cancel()
    unfinished = [t for t in pending if not t.done()]
    if not unfinished:
        return
    await cancel(unfinished)
    log.warning(
        "stopping: %d message(s) did not finish within the grace period; sent back to their"
        " queue unfinished",
        len(unfinished),
    )


async def cancel(tasks: Collection[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks``; a handler that swallows its cancellation holds no one for ever."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_TIMEOUT)
