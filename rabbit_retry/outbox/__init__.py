"""The publishing side: events written in the application's own transaction (``Outbox.add``)
and published afterwards, with confirms, by a relay (``rabbit-retry relay``, ``Relay``).

Importing this package loads neither SQLAlchemy nor the relay: an application that only adds
events pays for what ``add`` uses. ::

    ValueError
     └── UnknownDestination   add named an exchange or queue the topology does not declare
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rabbit_retry.outbox.add import MessageProperties, Outbox
from rabbit_retry.outbox.destinations import UnknownDestination

if TYPE_CHECKING:
    from rabbit_retry.outbox.relay import Relay, run_relay

__all__ = ["MessageProperties", "Outbox", "Relay", "UnknownDestination", "run_relay"]


def __getattr__(name: str) -> Any:
    if name in ("Relay", "run_relay"):
        from rabbit_retry.outbox import relay

        return getattr(relay, name)
    raise AttributeError(f"module 'rabbit_retry.outbox' has no attribute {name!r}")
