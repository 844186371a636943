"""Making sure the AMQP URL and the management API address the same broker.

Commands that read the broker through its management API and change it over AMQP (``plan``,
``apply``, ``status``) would otherwise report on one broker and act on another: a typo in a
port, or a management URL left at its default while ``--url`` names a remote broker. Both
interfaces report the cluster's name; they must agree.

On RabbitMQ 4.x a cluster whose name was never set reports a different name on each node (the
node's own), so AMQP on one node and the API of another disagree though they are one cluster.
When the names differ and the API's cluster has several nodes, the check asks the API whether
it sees the AMQP connection it is holding open (named uniquely), which only the same cluster
can.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from rabbit_retry.broker.connect import connect
from rabbit_retry.broker.management import Management
from rabbit_retry.contract import as_text
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings

# How long the API may take to list a new connection: its statistics are collected every
# collect_statistics_interval (5 s by default).
SEEN_WITHIN = 15.0


async def _amqp_identity(
    settings: Settings, api: Management, over_http: str | None
) -> tuple[str | None, bool]:
    """(the cluster name AMQP announces, whether ``api`` lists this very connection); the
    second is only asked when the names differ and ``api``'s cluster has several nodes."""
    token = f"rabbit-retry identity check {uuid.uuid4().hex}"
    connection = await connect(settings, name=token)
    try:
        transport = connection.transport
        assert transport is not None, "connected"
        name = as_text((transport.connection.server_properties or {}).get("cluster_name"))
        if name is None or over_http is None or name == over_http:
            return name, False
        nodes = _node_count(api)
        if nodes is not None and nodes < 2:  # a one-node cluster's name is its node's
            return name, False
        return name, await asyncio.to_thread(_listed, api, settings.vhost, token)
    finally:
        await connection.close()


def _node_count(api: Management) -> int | None:
    """How many nodes the cluster has, or None when the user may not list them (only the
    monitoring and administrator tags may): then the connection check alone decides."""
    if not api.may("monitoring"):
        return None
    return len(api.get("/nodes", columns="name"))


def _listed(api: Management, vhost: str, token: str) -> bool:
    deadline = time.monotonic() + SEEN_WITHIN
    while True:
        for connection in api.connections(vhost):
            if (connection.get("client_properties") or {}).get("connection_name") == token:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def check_same_broker(settings: Settings, api: Management) -> None:
    """``InputError`` in one line when the two URLs reach different clusters."""
    over_http = as_text(api.overview().get("cluster_name"))
    try:
        over_amqp, seen = asyncio.run(_amqp_identity(settings, api, over_http))
    except BrokerError as exc:
        if "refused the vhost" in str(exc):  # this API says precisely whether it is missing
            api.require_vhost(settings.vhost)
        raise
    if over_amqp is None or over_http is None or over_amqp == over_http or seen:
        return
    raise InputError(
        f"--url and --management-url reach different brokers: {settings.safe_url} is cluster "
        f"{over_amqp!r}, {settings.safe_management_url} is cluster {over_http!r}; give the "
        "management URL of the same broker, or leave it unset to follow --url"
    )
