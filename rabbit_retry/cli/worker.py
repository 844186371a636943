"""``rabbit-retry worker MODULE:CLASS -t FILE``: run consumers until SIGTERM / SIGINT."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

import click

from rabbit_retry.cli import pass_settings
from rabbit_retry.errors import InputError

if TYPE_CHECKING:
    from rabbit_retry.logs import Format
    from rabbit_retry.settings import Settings
    from rabbit_retry.worker.consumer import RetryConsumer


def load_consumer(spec: str) -> RetryConsumer:
    """``package.module:ClassName`` -> an instance; one ``InputError`` line when it cannot be."""
    from rabbit_retry.worker.consumer import RetryConsumer

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{spec!r}: expected MODULE:CLASS, e.g. app.consumers:FraudCheck")
    # Like `python -m`, find modules in the current directory first.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise InputError(f"{spec!r}: no module named {exc.name!r}") from exc
        raise InputError(f"{spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise InputError(
            f"{spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    target: object = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InputError(f"{spec!r}: module {module_name!r} has no {attr!r}") from None
    if not (isinstance(target, type) and issubclass(target, RetryConsumer)):
        raise InputError(f"{spec!r}: {attr} is not a RetryConsumer subclass")
    try:
        return target()
    except Exception as exc:
        raise InputError(f"{spec!r}: {attr}() failed: {type(exc).__name__}: {exc}") from exc


@click.command()
@click.argument("consumers", nargs=-1, required=True, metavar="MODULE:CLASS...",
                envvar="RABBIT_RETRY_CONSUMERS")
@click.option(
    "-t",
    "--topology",
    "topology_file",
    required=True,
    envvar="RABBIT_RETRY_TOPOLOGY",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The topology file the queues were provisioned from.",
)
@click.option(
    "--metrics-port",
    envvar="RABBIT_RETRY_METRICS_PORT",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    help="Serve Prometheus metrics on this port (0 picks a free one), with the probes /healthz"
    " (the process and its event loop are alive) and /readyz (connected and consuming).",
)
@click.option(
    "--metrics-addr",
    envvar="RABBIT_RETRY_METRICS_ADDR",
    default="0.0.0.0",
    show_default=True,
    metavar="ADDRESS",
    help="The address the metrics and probes listen on.",
)
@click.option(
    "--ready-when-paused",
    envvar="RABBIT_RETRY_READY_WHEN_PAUSED",
    is_flag=True,
    help="/readyz answers 200 while a Pause holds a queue (by default 503: its downstream"
    " fails).",
)
@click.option(
    "--grace",
    envvar="RABBIT_RETRY_GRACE",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds in-flight handlers get to finish after SIGTERM / SIGINT.",
)
@click.option(
    "--log-level",
    envvar="RABBIT_RETRY_LOG_LEVEL",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="debug also logs every successful message.",
)
@click.option(
    "--log-format",
    envvar="RABBIT_RETRY_LOG_FORMAT",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one object per line, with queue, message_id, attempt, outcome and the exception's"
    " type and message as keys (bodies never).",
)
@pass_settings
def worker(
    settings: Settings,
    consumers: tuple[str, ...],
    topology_file: str,
    metrics_port: int | None,
    metrics_addr: str,
    ready_when_paused: bool,
    grace: float,
    log_level: str,
    log_format: Format,
) -> None:
    """Run one or more RetryConsumer classes against the queues of FILE.

    Every option can also be set from the environment (RABBIT_RETRY_TOPOLOGY,
    RABBIT_RETRY_METRICS_PORT, RABBIT_RETRY_GRACE, RABBIT_RETRY_LOG_FORMAT, ...; the consumers
    as RABBIT_RETRY_CONSUMERS, space-separated).
    """
    import asyncio

    from rabbit_retry.logs import configure
    from rabbit_retry.topology.apart import load_topology_apart
    from rabbit_retry.worker.runner import run_consumers

    configure(log_level, log_format)
    topology = load_topology_apart(topology_file)
    instances = [load_consumer(spec) for spec in consumers]
    asyncio.run(
        run_consumers(
            instances,
            topology=topology,
            settings=settings,
            grace=grace,
            metrics_port=metrics_port,
            metrics_addr=metrics_addr,
            ready_when_paused=ready_when_paused,
        )
    )


COMMANDS = {"worker": worker}
