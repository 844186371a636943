"""How long to wait before trying again: the one backoff rule of every retry loop in
rabbit-retry (reconnects, held publishes, stores that fail, the desk's ingest).

Capped exponential with jitter: after the n-th failure in a row, a delay drawn from the upper
half of ``min(maximum, initial * 2 ** (n - 1))``, so that workers that lost the same broker at
the same moment do not come back in step, and no wait ever exceeds ``maximum``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass


@dataclass
class Backoff:
    """A streak of failures and the wait each one earns; ``succeeded`` ends the streak."""

    initial: float
    maximum: float
    failures: int = 0

    def failed(self) -> float:
        """Count one more failure; the seconds to wait before the next try."""
        self.failures += 1
        ceiling = min(self.maximum, self.initial * 2 ** min(self.failures - 1, 32))
        delay: float = ceiling / 2 + random.uniform(0, ceiling / 2)
        return delay

    def succeeded(self) -> int:
        """End the streak; how many failures it had (0: there was none to report)."""
        failures, self.failures = self.failures, 0
        return failures

    async def wait(self) -> None:
        """Count a failure and sleep for its delay."""
        await asyncio.sleep(self.failed())
