"""``rabbit-retry relay --store URL -t FILE``: the outbox relay (README, "The outbox")."""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import click

from rabbit_retry.cli import pass_settings
from rabbit_retry.errors import InputError

if TYPE_CHECKING:
    from rabbit_retry.settings import Settings

STORE_ENV = "RABBIT_RETRY_OUTBOX_STORE"


def _seconds(option: str, value: str) -> float:
    """A duration in the topology's notation (``30s``, ``7d``), in seconds."""
    from rabbit_retry.topology.durations import parse_duration

    try:
        return parse_duration(value, limit_ms=None) / 1000
    except ValueError as exc:
        raise InputError(f"{option}: {exc}") from None


@click.command()
@click.option("--store", "store_url", envvar=STORE_ENV, metavar="URL",
              help="The application's database that holds the outbox: "
              f"postgresql://user:pass@host/db or sqlite:///PATH  [env: {STORE_ENV}; required]")
@click.option("-t", "--topology", "topology_file", required=True,
              type=click.Path(dir_okay=False), metavar="FILE",
              help="The topology file the events' destinations come from.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), metavar="PORT",
              help="Serve Prometheus metrics on this port (0 picks a free one).")
@click.option("--keep", default="1d", show_default=True, metavar="DURATION",
              help="How long published (and discarded) events stay in the table.")
@click.option("--on-failure", type=click.Choice(["hold", "continue"]), default="hold",
              show_default=True,
              help="hold: an event the broker refused holds the later events of its order key "
              "until it is published, retried or discarded; continue: they go on without it.")
@click.option("--attempts", type=click.IntRange(min=1), default=10, show_default=True,
              metavar="N", help="Publishes an event gets before it is dead (waits for an "
              "operator).")
@click.option("--retry-delay", default="5s", show_default=True, metavar="DURATION",
              help="The wait before a failed event's second try; it doubles at each failure.")
@click.option("--max-retry-delay", default="10m", show_default=True, metavar="DURATION",
              help="The longest wait between two tries.")
@click.option("--batch", type=click.IntRange(1, 10000), default=500, show_default=True,
              metavar="N", help="Events per claim.")
@click.option("--depth", type=click.IntRange(1, 64), default=4, show_default=True, metavar="N",
              help="Claims in flight at once (up to DEPTH x BATCH events await their confirm: "
              "what a killed relay may publish twice).")
@click.option("--poll", type=click.FloatRange(min=0, min_open=True), default=0.1,
              show_default=True, metavar="SECONDS",
              help="How often an idle relay looks for new events.")
@click.option("--no-migrate", "migrate", flag_value=False, default=True,
              help="Never change the schema (teams that apply the outbox's SQL themselves); "
              "check it instead.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True, help="Logging threshold.")
@pass_settings
def relay(settings: Settings, store_url: str | None, topology_file: str,
          metrics_port: int | None, keep: str, on_failure: str, attempts: int,
          retry_delay: str, max_retry_delay: str, batch: int, depth: int, poll: float,
          migrate: bool, log_level: str) -> None:
    """Publish the events the application added to its outbox, with confirms.

    Several relays may share one PostgreSQL outbox; on SQLite one publishes at a time and the
    others wait. Stops on SIGTERM / SIGINT once the events in flight are confirmed.
    """
    import asyncio

    from rabbit_retry.database import engine_url
    from rabbit_retry.outbox.decide import RetryPolicy
    from rabbit_retry.outbox.relay import run_relay
    from rabbit_retry.topology import load_topology

    if not store_url:
        raise InputError(f"--store is required (or set {STORE_ENV})")
    engine_url(store_url)  # a bad URL is bad input: say so before anything else
    first = _seconds("--retry-delay", retry_delay)
    longest = _seconds("--max-retry-delay", max_retry_delay)
    if not 0 < first <= longest:
        raise InputError("--retry-delay: more than 0 and at most --max-retry-delay")
    kept = timedelta(seconds=_seconds("--keep", keep))
    topology = load_topology(topology_file)
    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if log_level != "debug":
        for name in ("aiormq", "aio_pika", "alembic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    asyncio.run(run_relay(store_url, topology, settings, keep=kept,
                          on_failure="hold" if on_failure == "hold" else "continue",
                          retry=RetryPolicy(attempts, first, longest), batch=batch,
                          depth=depth, poll=poll, migrate=migrate, metrics_port=metrics_port))


COMMANDS = {"relay": relay}
