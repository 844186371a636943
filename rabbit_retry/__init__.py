"""rabbit-retry: broker-native retries for RabbitMQ.

The worker API is imported on first use, so ``rabbit-retry`` commands that never run a worker
do not pay for loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rabbit_retry.worker import (
        Delivery,
        InvalidPayload,
        Permanent,
        RetryConsumer,
        Runner,
        run,
        run_consumers,
    )

__version__ = "0.1.0"

__all__ = [
    "Delivery",
    "InvalidPayload",
    "Permanent",
    "RetryConsumer",
    "Runner",
    "__version__",
    "run",
    "run_consumers",
]


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        from rabbit_retry import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'rabbit_retry' has no attribute {name!r}")
