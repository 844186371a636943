"""Making sure the AMQP URL and the management API address the same broker.

Commands that read the broker through its management API and change it over AMQP (``plan``,
``apply``, ``status``) would otherwise report on one broker and act on another: a typo in a
port, or a management URL left at its default while ``--url`` names a remote broker. Both
interfaces report the cluster's name; they must agree.
"""

from __future__ import annotations

import asyncio

from rabbit_retry.broker.connect import connect
from rabbit_retry.broker.management import Management
from rabbit_retry.contract import as_text
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings


async def amqp_cluster_name(settings: Settings) -> str | None:
    """The cluster name the broker at ``settings.url`` announces (``BrokerError`` when it
    cannot be reached)."""
    connection = await connect(settings, name="rabbit-retry identity check")
    try:
        transport = connection.transport
        assert transport is not None, "connected"
        return as_text((transport.connection.server_properties or {}).get("cluster_name"))
    finally:
        await connection.close()


def check_same_broker(settings: Settings, api: Management) -> None:
    """``InputError`` in one line when the two URLs reach different clusters."""
    over_http = as_text(api.overview().get("cluster_name"))
    try:
        over_amqp = asyncio.run(amqp_cluster_name(settings))
    except BrokerError as exc:
        if "refused the vhost" in str(exc):  # this API says precisely whether it is missing
            api.require_vhost(settings.vhost)
        raise
    if over_amqp is None or over_http is None or over_amqp == over_http:
        return
    raise InputError(
        f"--url and --management-url reach different brokers: {settings.safe_url} is cluster "
        f"{over_amqp!r}, {settings.safe_management_url} is cluster {over_http!r}; give the "
        "management URL of the same broker, or leave it unset to follow --url"
    )
