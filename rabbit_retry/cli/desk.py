"""``rabbit-retry desk FILE``: the failure desk (README, "The failure desk")."""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import click

from rabbit_retry.cli import pass_settings
from rabbit_retry.errors import InputError

if TYPE_CHECKING:
    from rabbit_retry.settings import Settings

STORE_ENV = "RABBIT_RETRY_DESK_STORE"
TOKEN_ENV = "RABBIT_RETRY_DESK_TOKEN"
ACCESS_ENV = "RABBIT_RETRY_DESK_ACCESS"
HOSTS_ENV = "RABBIT_RETRY_DESK_HOSTS"
OUTBOX_ENV = "RABBIT_RETRY_OUTBOX_STORE"  # the relay's --store: the same database
DEFAULT_STORE = "sqlite:///rabbit-retry-desk.db"


def _keep(value: str) -> timedelta:
    from rabbit_retry.topology.durations import parse_duration

    try:
        ms = parse_duration(value, limit_ms=None)
    except ValueError as exc:
        raise InputError(f"--keep: {exc}") from None
    return timedelta(milliseconds=ms)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False), metavar="FILE")
@click.option("--store", "store_url", envvar=STORE_ENV, default=DEFAULT_STORE, show_default=True,
              metavar="URL", help="sqlite:///PATH or postgresql://user:pass@host/db")
@click.option("--listen", default="127.0.0.1:8025", show_default=True, metavar="HOST:PORT",
              help="HOST:PORT of the page and the API.")
@click.option("--keep", default="30d", show_default=True, metavar="DURATION",
              help="How long replayed and discarded messages are kept (the audit: forever).")
@click.option("--access", "access_file", envvar=ACCESS_ENV, metavar="FILE",
              help="Who may use the desk: named operators and roles, a trusted proxy, a "
                   "/metrics credential.")
@click.option("--outbox", "outbox_url", envvar=OUTBOX_ENV, metavar="URL",
              help="An application's outbox database (the relay's --store): its dead and "
                   "failed events shown beside the parked messages, to retry or discard.")
@pass_settings
def desk(settings: Settings, file: str, store_url: str, listen: str, keep: str,
         access_file: str | None, outbox_url: str | None) -> None:
    """Consume FILE's parking queues into a store; serve a page and a JSON API over them."""
    import asyncio

    from rabbit_retry.desk.auth import load_access
    from rabbit_retry.desk.serve import check_exposure, parse_listen, serve
    from rabbit_retry.desk.store import engine_url
    from rabbit_retry.topology import load_topology

    access = load_access(access_file or None, os.environ.get(TOKEN_ENV) or None,
                         hosts=os.environ.get(HOSTS_ENV, "").split(","))
    where = parse_listen(listen)
    check_exposure(where, access)
    engine_url(store_url)  # a bad URL is bad input: say so before anything else
    if outbox_url:
        from rabbit_retry.database import engine_url as outbox_engine_url

        outbox_engine_url(outbox_url, "--outbox")
    kept = _keep(keep)
    topology = load_topology(file)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for name in ("aiormq", "aio_pika", "alembic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    asyncio.run(serve(topology, settings, store_url=store_url, listen=where, keep=kept,
                      access=access, outbox_url=outbox_url or None))


COMMANDS = {"desk": desk}
