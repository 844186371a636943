"""Both example consumers in one process, started from Python instead of the command line.

    python -m examples.run_all          # RABBIT_RETRY_URL picks the broker and vhost

``run`` blocks until SIGTERM or Ctrl-C, then lets in-flight messages finish (up to ``grace``
seconds) before closing; ``run_consumers`` is the same as a coroutine, for an application that
already has an event loop.
"""

from __future__ import annotations

import logging
from pathlib import Path

from examples.orders_consumers import FraudCheck, Inventory
from rabbit_retry import run

TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "orders.yml"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run([FraudCheck(), Inventory()], topology=TOPOLOGY, grace=30.0, metrics_port=9100)


if __name__ == "__main__":
    main()
