"""``rabbit-retry worker MODULE:CLASS -t FILE``: run consumers until SIGTERM / SIGINT."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

import click

from rabbit_retry.cli import pass_settings
from rabbit_retry.errors import InputError

if TYPE_CHECKING:
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
@click.argument("consumers", nargs=-1, required=True, metavar="MODULE:CLASS...")
@click.option(
    "-t",
    "--topology",
    "topology_file",
    required=True,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The topology file the queues were provisioned from.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    help="Serve Prometheus metrics on this port (0 picks a free one).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds in-flight handlers get to finish after SIGTERM / SIGINT.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="debug also logs every successful message.",
)
@pass_settings
def worker(
    settings: Settings,
    consumers: tuple[str, ...],
    topology_file: str,
    metrics_port: int | None,
    grace: float,
    log_level: str,
) -> None:
    """Run one or more RetryConsumer classes against the queues of FILE."""
    import asyncio

    from rabbit_retry.topology.apart import load_topology_apart
    from rabbit_retry.worker.runner import run_consumers

    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if log_level != "debug":
        # aiormq and aio-pika log a lost connection with a traceback, and every closed channel;
        # the worker says each outage once, in one line.
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    topology = load_topology_apart(topology_file)
    instances = [load_consumer(spec) for spec in consumers]
    asyncio.run(
        run_consumers(
            instances,
            topology=topology,
            settings=settings,
            grace=grace,
            metrics_port=metrics_port,
        )
    )


COMMANDS = {"worker": worker}
