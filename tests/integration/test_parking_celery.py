"""A message without a message id (a Celery task: its id is the correlation id) parked by the
real worker: ``parking show`` marks the id the copy got as generated and shows the correlation
id, in the table and with ``--json``; a replay keeps both."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pika
from support.amqp import blocking
from support.provision import provision, topology
from support.worker import run_until_parked

from rabbit_retry.settings import Settings
from rabbit_retry.worker import Delivery, Permanent, RetryConsumer

TOPOLOGY = """
version: 1
queues:
  tasks:
    retry: {delays: [1s], max_attempts: 1}
"""


class Declines(RetryConsumer):
    queue = "tasks"

    async def handle(self, delivery: Delivery) -> None:
        raise Permanent("no such customer")


def test_a_message_without_an_id_is_shown_by_its_correlation_id(
    fresh_vhost: Settings, run_cli: Callable[..., Any],
) -> None:
    topo = topology(TOPOLOGY)
    blocking(provision(fresh_vhost, topo))
    # With pika, as Celery's client does: aiormq (so aio-pika) gives every message an id.
    connection = pika.BlockingConnection(pika.URLParameters(fresh_vhost.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, properties in (
            (b'{"task": "charge"}', pika.BasicProperties(correlation_id="task-42")),
            (b'{"task": "ship"}', pika.BasicProperties(message_id="own-id")),
        ):
            channel.basic_publish("", "tasks", body, properties, mandatory=True)
    finally:
        connection.close()

    run_until_parked([Declines()], topo, fresh_vhost, "tasks", 2)
    for _ in range(2):  # once parked, once parked again after a replay
        shown = run_cli("parking", "show", "tasks", "--json", settings=fresh_vhost)
        assert shown.code == 0, shown.err
        by_correlation = {m["correlation_id"]: m for m in json.loads(shown.out)["messages"]}
        celery, own = by_correlation["task-42"], by_correlation[None]
        assert celery["message_id_generated"] is True and celery["message_id"]
        assert (own["message_id"], own["message_id_generated"]) == ("own-id", False)
        table = " ".join(run_cli("parking", "show", "tasks", settings=fresh_vhost).out.split())
        # (a narrow terminal wraps the cells: the words, not their neighbours)
        assert table.count("(generated)") == 1 and "task-42" in table and "own-id" in table
        replayed = run_cli("parking", "replay", "tasks", "--yes", settings=fresh_vhost)
        assert replayed.code == 0, replayed.err
        run_until_parked([Declines()], topo, fresh_vhost, "tasks", 2)
        again = json.loads(run_cli("parking", "show", "tasks", "--json",
                                   settings=fresh_vhost).out)["messages"]
        assert {m["message_id"] for m in again} == {celery["message_id"], "own-id"}
