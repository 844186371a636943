"""What a consumer declares to handle each message once: ``Idempotency``. The worker's side of
it (claims, leases, a store that fails) is ``dedupe``, loaded only for a consumer that has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rabbit_retry.errors import InputError
from rabbit_retry.worker.checks import require_seconds

if TYPE_CHECKING:
    from rabbit_retry.worker.consumer import Delivery

DEFAULT_WINDOW = 86400.0


def by_message_id(delivery: Delivery[Any]) -> str | None:
    """The default key: the message's ``message_id`` property."""
    return delivery.message_id or None


@dataclass(frozen=True)
class Idempotency:
    """Handle a message whose key was handled successfully within ``window`` seconds only once.

    ``store``: ``sqlite:///PATH`` (one machine), ``postgresql://...`` or ``redis://...`` (several
    workers). ``key``: a function of the delivery (``message_id`` by default); a message
    without a key is handled as usual. ``lease``: how long a claim holds when the worker holding
    it dies (default: the handler's timeout plus 30 s). ``replayers``: the users whose replays
    may ask for a done key to run again (``handle-again``); default: the worker's own user.
    """

    store: str
    key: Callable[[Delivery[Any]], str | None] = by_message_id
    window: float = DEFAULT_WINDOW
    lease: float | None = None
    replayers: tuple[str, ...] | None = None

    def check(self, owner: str) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise InputError(f"{owner}.idempotency.store: expected a store URL, got {self.store!r}")
        if not callable(self.key):
            raise InputError(f"{owner}.idempotency.key: expected a function, got {self.key!r}")
        require_seconds(f"{owner}.idempotency.window", self.window)
        if self.lease is not None:
            require_seconds(f"{owner}.idempotency.lease", self.lease)
        if self.replayers is not None and (
            not isinstance(self.replayers, tuple)
            or not all(isinstance(u, str) and u for u in self.replayers)
        ):
            raise InputError(f"{owner}.idempotency.replayers: expected a tuple of user names or"
                             f" None, got {self.replayers!r}")
