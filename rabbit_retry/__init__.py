"""rabbit-retry: broker-native retries for RabbitMQ.

The public API is below; everything else is internal. The worker API is imported on first use,
so ``rabbit-retry`` commands that never run a worker do not pay for loading it.

Exceptions a handler raises or meets::

    Exception
     ├── Permanent          raise it to park the message at once
     ├── InvalidPayload     reading ``delivery.payload`` of a body that is not JSON (parks it)
     └── TimeoutError
          └── HandlerTimeout  the handler ran past ``handler_timeout`` (retried)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rabbit_retry.settings import Settings
    from rabbit_retry.worker import (
        NOT_DECODED,
        Batch,
        BatchResult,
        Delivery,
        HandlerTimeout,
        Idempotency,
        InvalidPayload,
        Pause,
        Permanent,
        RetryConsumer,
        Runner,
        run,
        run_consumers,
    )

__version__ = "0.1.0"

__all__ = [
    "NOT_DECODED",
    "Batch",
    "BatchResult",
    "Delivery",
    "HandlerTimeout",
    "Idempotency",
    "InvalidPayload",
    "Pause",
    "Permanent",
    "RetryConsumer",
    "Runner",
    "Settings",
    "__version__",
    "run",
    "run_consumers",
]


def __getattr__(name: str) -> Any:
    if name == "Settings":
        from rabbit_retry.settings import Settings

        return Settings
    if name in __all__ and name != "__version__":
        from rabbit_retry import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'rabbit_retry' has no attribute {name!r}")
