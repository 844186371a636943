"""End to end with the real worker: messages parked by ``rabbit-retry``'s own worker are shown,
replayed (failing again, they park again with their replay-count), replayed once the cause is
fixed, purged and exported by the ``parking`` commands, every message counted."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aio_pika
from support.amqp import blocking, depth_sync, persistent, publish_stream
from support.parked import look
from support.poll import wait_for
from support.provision import provision

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.topology import parse_topology
from rabbit_retry.worker import Delivery, RetryConsumer, Runner
from rabbit_retry.worker.metrics import Metrics

TOPOLOGY = """
version: 1
exchanges: {orders: {type: topic}}
queues:
  orders:
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [200ms], max_attempts: 2}
"""
DEADLINE_S = 60.0
Run = Callable[..., Any]

# (message id, what the handler does with it)
MESSAGES = [("f0", "flaky"), ("p0", "perm"), ("ok0", "ok"), ("f1", "flaky"), ("bad", None),
            ("p1", "perm"), ("f2", "flaky"), ("ok1", "ok")]
FLAKY = {"f0", "f1", "f2"}


class Orders(RetryConsumer):
    queue = "orders"
    prefetch = 10
    handler_timeout = 10.0
    permanent_errors = (KeyError,)

    def __init__(self) -> None:
        self.fixed = False
        self.calls: list[tuple[str | None, int, dict[str, Any]]] = []
        self.done: list[str | None] = []

    async def handle(self, delivery: Delivery) -> None:
        self.calls.append((delivery.message_id, delivery.attempt, dict(delivery.headers)))
        kind = delivery.payload["kind"]  # the body that is not JSON parks as invalid here
        if kind == "perm":
            raise KeyError("no such customer")
        if kind == "flaky" and not self.fixed:
            raise ValueError("upstream down")
        self.done.append(delivery.message_id)

    def attempts(self, message_id: str) -> list[int]:
        return [attempt for mid, attempt, _ in self.calls if mid == message_id]


class Worker:
    """The real worker, running in a thread of its own so the test can call the CLI."""

    def __init__(self, consumer: RetryConsumer, settings: Settings) -> None:
        self.runner = Runner([consumer], topology=parse_topology(TOPOLOGY, "orders.yml"),
                             settings=settings, grace=5.0, metrics=Metrics())
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            task = asyncio.create_task(self.runner.run())
            ready = asyncio.create_task(self.runner.ready.wait())
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            self._ready.set()
            await task

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def __enter__(self) -> Worker:
        self._thread.start()
        assert self._ready.wait(DEADLINE_S), "worker did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._loop.call_soon_threadsafe(self.runner.stop)
        self._thread.join(DEADLINE_S)


def publish_orders(settings: Settings) -> None:
    def make(i: int) -> aio_pika.Message:
        message_id, kind = MESSAGES[i]
        body = b"not json" if kind is None else json.dumps({"kind": kind}).encode()
        return persistent(body, message_id=message_id, content_type="application/json")

    # One at a time: the test reads the parking queue in the order they were published.
    blocking(publish_stream(settings, "order.created", len(MESSAGES), make, exchange="orders",
                            window=1))


def parked_now(settings: Settings) -> int:
    return depth_sync(settings, "orders.parking")


def show(run_cli: Run, settings: Settings) -> dict[str, Any]:
    result = run_cli("parking", "show", "orders", "--json", settings=settings)
    assert result.code == 0, result.err
    data: dict[str, Any] = json.loads(result.out)
    return data


def test_parked_by_the_worker_then_shown_replayed_purged_and_exported(
    fresh_vhost: Settings, run_cli: Run, management: Management, tmp_path: Path
) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    consumer = Orders()
    with Worker(consumer, fresh_vhost):
        publish_orders(fresh_vhost)
        wait_for(lambda: parked_now(fresh_vhost) == 6 and len(consumer.done) == 2,
                 "6 parked and 2 handled")
        assert sorted(consumer.done) == ["ok0", "ok1"]

        # show: twice, nothing moves
        oracle = [s.properties["message_id"] for s in look(management, fresh_vhost,
                                                            "orders.parking")]
        for _ in range(2):
            data = show(run_cli, fresh_vhost)
            assert [m["message_id"] for m in data["messages"]] == oracle
            assert parked_now(fresh_vhost) == 6
        by_id = {m["message_id"]: m for m in data["messages"]}
        assert set(by_id) == {"f0", "f1", "f2", "p0", "p1", "bad"}
        for mid in FLAKY:
            assert (by_id[mid]["reason"], by_id[mid]["exception_type"],
                    by_id[mid]["exception_message"], by_id[mid]["attempts"]) == (
                "exhausted", "ValueError", "upstream down", 2)
        for mid in ("p0", "p1"):
            assert (by_id[mid]["reason"], by_id[mid]["exception_type"]) == ("permanent",
                                                                             "KeyError")
        assert by_id["bad"]["reason"] == "invalid"
        assert {(m["original_exchange"], m["original_routing_key"], m["original_queue"])
                for m in data["messages"]} == {("orders", "order.created", "orders")}
        assert data["groups"]["by_reason"] == {"exhausted": 3, "permanent": 2, "invalid": 1}

        # replay while still broken: they fail again and park again, replay-count kept
        result = run_cli("parking", "replay", "orders", "--where", "exception-type=ValueError",
                         "--yes", settings=fresh_vhost)
        assert result.out == ("replayed 3 of 6 parked messages from 'orders.parking' to "
                              "'orders' (exception-type=ValueError); 3 left parked\n")
        wait_for(lambda: all(len(consumer.attempts(m)) == 4 for m in FLAKY)
                 and parked_now(fresh_vhost) == 6, "the replayed messages to park again")
        assert {m: consumer.attempts(m) for m in FLAKY} == {m: [1, 2, 1, 2] for m in FLAKY}
        again = {m["message_id"]: m for m in show(run_cli, fresh_vhost)["messages"]}
        for mid in FLAKY:
            assert (again[mid]["replay_count"], again[mid]["attempts"], again[mid]["reason"],
                    again[mid]["original_exchange"], again[mid]["original_routing_key"]) == (
                1, 2, "exhausted", "orders", "order.created")
        assert {again[m]["replay_count"] for m in ("p0", "p1", "bad")} == {0}

        # fixed: replayed once more, handled, replay-count 2 seen by the handler
        consumer.fixed = True
        result = run_cli("parking", "replay", "orders", "--where", "exception-type=ValueError",
                         "--yes", settings=fresh_vhost)
        assert result.out.startswith("replayed 3 of 6 parked messages")
        wait_for(lambda: set(consumer.done) >= FLAKY, "the fixed handler to take them")
        last = {mid: headers for mid, _, headers in consumer.calls if mid in FLAKY}
        assert {mid: h.get("replay-count") for mid, h in last.items()} == dict.fromkeys(FLAKY, 2)
        assert all("parked-reason" not in h and "retry-count" not in h for h in last.values())
        assert parked_now(fresh_vhost) == 3

    # purge the permanent ones; export what is left
    result = run_cli("parking", "purge", "orders", "--where", "parked-reason=permanent", "--yes",
                     settings=fresh_vhost)
    assert result.out == ("deleted 2 of 3 parked messages from 'orders.parking' "
                          "(parked-reason=permanent); 1 left parked\n")
    out = tmp_path / "left.jsonl"
    assert run_cli("parking", "export", "orders", "--out", str(out),
                   settings=fresh_vhost).code == 0
    (record,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert (record["properties"]["message_id"], record["body"], record["body_encoding"],
            record["headers"]["parked-reason"]) == ("bad", "not json", "utf-8", "invalid")
    assert parked_now(fresh_vhost) == 1
    assert depth_sync(fresh_vhost, "orders") == 0
