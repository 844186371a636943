"""The worker's side of ``Idempotency`` (``idempotency``): a ``Deduper`` per consumer over an
opened ``Store`` (``stores``).

Per delivery with a key: *claim* it; a key done within the window is a duplicate (acked, the
handler not called); a key another worker holds is waited for (its outcome decides); otherwise
the handler runs and the key becomes *done* on success, or is *released* on failure so the retry
can claim it again. The claim is recorded before the handler runs and *done* before the ack: a
worker killed after the handler's side effect but before *done* leaves a claim that runs out
after the lease, and the message is then handled again. That gap is the one duplicate this
cannot prevent without the side effect and the store sharing one transaction.

A store that fails is retried with backoff while the delivery waits: the queue slows down
instead of handling a message twice or losing it.

An operator's replay may ask for a message to run although its key is done (``handle-again``,
``parking replay --handle-again``). A publisher could write that header too, so it is believed
only on a message whose ``user_id`` names one of the rule's ``replayers`` (the worker's own user
by default): RabbitMQ refuses a publish whose ``user_id`` is not the publishing connection's
user, and a replay publishes its copies under its own.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rabbit_retry.backoff import Backoff
from rabbit_retry.contract import HANDLE_AGAIN, as_flag
from rabbit_retry.settings import mask
from rabbit_retry.worker.idempotency import Idempotency
from rabbit_retry.worker.stores import Store, Verdict, open_store

if TYPE_CHECKING:
    from rabbit_retry.worker.consumer import Delivery

log = logging.getLogger("rabbit_retry.worker")

# A claim outlives the handler's timeout by this much before another worker may take the key
# (the worker holding it died); without a timeout, LEASE_WITHOUT_TIMEOUT in all.
LEASE_MARGIN = 30.0
LEASE_WITHOUT_TIMEOUT = 300.0
BUSY_POLL = (0.05, 1.0)  # first and largest pause between looks at a key another worker holds
STORE_RETRY = (0.2, 10.0)  # first and largest pause between tries of a failing store


@dataclass
class Ticket:
    """A delivery's standing with the store: run the handler (``token`` set, or None when the
    message has no key or asks to be handled again) or not (``duplicate``)."""

    key: str | None
    token: str | None = None
    duplicate: bool = False
    gone: bool = False  # the delivery's channel closed while it waited: the broker has it


class Deduper:
    """One consumer's ``Idempotency`` at work over an opened ``Store``."""

    def __init__(
        self,
        rule: Idempotency,
        store: Store,
        scope: str,
        consumer: str,
        timeout: float | None,
        user: str = "",
        batch_wait: float = 0.0,
    ) -> None:
        self.rule = rule
        self.replayers = frozenset(rule.replayers if rule.replayers is not None else (user,))
        self.store = store
        self.scope = scope
        self.consumer = consumer
        # The default covers what a claimed delivery may take: the handler's timeout, and a
        # batch consumer's wait for its batch before that (the claim comes first).
        if rule.lease is not None:
            self.lease = rule.lease
        elif timeout is not None:
            self.lease = batch_wait + timeout + LEASE_MARGIN
        else:
            self.lease = batch_wait + LEASE_WITHOUT_TIMEOUT
        self._said_no_key = False

    async def admit(
        self, delivery: Delivery[Any], user_id: str | None, alive: Callable[[], bool]
    ) -> Ticket:
        """Claim the delivery's key, waiting while another worker holds it (``user_id``: the
        message's, which the broker checked against its publisher).

        ``alive`` says whether the delivery can still be settled; once it cannot (its channel
        closed), waiting ends with a ticket that runs nothing (the broker has it back).
        """
        key = self.rule.key(delivery)
        if key is None:
            if not self._said_no_key:
                self._said_no_key = True
                log.warning(
                    "queue=%s consumer=%s: a message without a key (message_id) is handled"
                    " without deduplication; said once",
                    self.scope,
                    self.consumer,
                    extra={"queue": self.scope, "event": "no_idempotency_key"},
                )
            return Ticket(None, None)
        key = str(key)
        if as_flag(delivery.headers.get(HANDLE_AGAIN)) and user_id in self.replayers:
            return Ticket(key, None)  # an operator's replay asked to run it again
        token = uuid.uuid4().hex
        poll = BUSY_POLL[0]
        while True:
            claim = await self._retrying("claim", lambda: self.store.claim(
                self.scope, key, token, self.lease), alive)
            if claim is None:
                return Ticket(key, gone=True)
            if claim.verdict is Verdict.CLAIMED:
                return Ticket(key, token)
            if claim.verdict is Verdict.DUPLICATE:
                return Ticket(key, None, duplicate=True)
            if not alive():
                return Ticket(key, gone=True)
            # Another worker holds it: its success makes this a duplicate, its failure or
            # death (the lease runs out) hands the key to us.
            await asyncio.sleep(min(poll, max(claim.expires_in, BUSY_POLL[0])))
            poll = min(poll * 2, BUSY_POLL[1])

    async def succeeded(self, ticket: Ticket, alive: Callable[[], bool]) -> None:
        if ticket.key is None:
            return
        key = ticket.key
        token = ticket.token or uuid.uuid4().hex
        await self._retrying(
            "done", lambda: self.store.done(self.scope, key, token, self.rule.window), alive
        )

    async def failed(self, ticket: Ticket, alive: Callable[[], bool]) -> None:
        if ticket.key is None or ticket.token is None:
            return
        key, token = ticket.key, ticket.token
        await self._retrying("release", lambda: self.store.release(self.scope, key, token), alive)

    async def _retrying(self, what: str, call: Callable[[], Any], alive: Callable[[], bool]) -> Any:
        """``call()`` until it works or the delivery is gone (then None); logged once per
        outage, not per try."""
        backoff = Backoff(*STORE_RETRY)
        while True:
            try:
                result = await call()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not backoff.failures:
                    log.warning(
                        "queue=%s: idempotency store %s failed (%s: %s); retrying, the message"
                        " waits",
                        self.scope,
                        what,
                        type(exc).__name__,
                        mask(str(exc)),
                        extra={"queue": self.scope, "event": "store_failing"},
                    )
                if not alive():
                    return None
                await backoff.wait()
                continue
            if backoff.succeeded():
                log.warning("queue=%s: idempotency store works again", self.scope,
                            extra={"queue": self.scope, "event": "store_recovered"})
            return result if result is not None else True


async def open_stores(rules: dict[int, Idempotency]) -> dict[str, Store]:
    """One opened store per distinct URL of ``rules`` (keyed by URL); closes what it opened if
    one fails."""
    opened: dict[str, Store] = {}
    try:
        for url in {rule.store for rule in rules.values()}:
            store = open_store(url)
            await store.open()
            opened[url] = store
    except BaseException:
        await close_stores(opened)
        raise
    return opened


async def close_stores(stores: dict[str, Store]) -> None:
    for store in stores.values():
        try:
            await store.close()
        except Exception as exc:  # closing must not hide why we stop
            log.debug("closing idempotency store %s: %r", store.url, exc)
