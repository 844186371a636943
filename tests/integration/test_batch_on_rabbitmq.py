"""A batch consumer on the real broker: one batch, each delivery its own path (acked, retried
through its tier, parked), on quorum and classic queues; the in-memory tests
(tests/unit/test_worker_batch.py) cover the rest on every version."""

from __future__ import annotations

import pytest
from support.amqp import all_empty, drain, publish
from support.poll import eventually
from support.provision import provision, topology
from support.worker import running, scraped

from rabbit_retry import Batch, BatchResult, Delivery, Permanent, RetryConsumer, metric_names
from rabbit_retry.settings import Settings

Q = "batch.q"


class Load(RetryConsumer):
    queue = Q
    batch = Batch(size=10, wait=0.3)

    def __init__(self) -> None:
        self.batches: list[list[tuple[str | None, int]]] = []

    async def handle_batch(self, deliveries: list[Delivery]) -> BatchResult | None:
        self.batches.append([(d.message_id, d.attempt) for d in deliveries])
        failed: dict[Delivery, BaseException] = {}
        for d in deliveries:
            if d.message_id == "ghost":
                failed[d] = Permanent("no such sku")
            elif d.message_id == "flaky" and d.attempt == 1:
                failed[d] = RuntimeError("busy")
        return BatchResult(failed=failed)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_batch_acks_retries_and_parks_each_delivery_on_its_own(
    fresh_vhost: Settings, queue_type: str
) -> None:
    topo = topology(f"""\
version: 1
queues:
  {Q}:
    queue_type: {queue_type}
    retry: {{delays: [300ms], max_attempts: 3}}
""")
    await provision(fresh_vhost, topo)
    consumer = Load()
    async with running([consumer], topo, fresh_vhost) as runner:
        for message_id in ("a", "flaky", "ghost", "b"):
            await publish(fresh_vhost, b"{}", routing_key=Q, message_id=message_id)
        await eventually(lambda: scraped(runner, metric_names.MESSAGES, Q, "success") == 3,
                         what="a, b and flaky (on its second attempt) acked")
        await eventually(lambda: all_empty(fresh_vhost, Q, f"{Q}.retry.300ms"),
                         what="nothing left in the queue or its tier")
        assert scraped(runner, metric_names.MESSAGES, Q, "retried") == 1
        assert scraped(runner, metric_names.PARKED, Q, "permanent") == 1
    [parked] = await drain(fresh_vhost, Q + ".parking")
    assert (parked.message_id, parked.headers["exception-message"]) == ("ghost", "no such sku")
    handled = sorted(call for batch in consumer.batches for call in batch)
    assert handled == [("a", 1), ("b", 1), ("flaky", 1), ("flaky", 2), ("ghost", 1)]
    assert any(len(batch) > 1 for batch in consumer.batches)  # they did share a batch
