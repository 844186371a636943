"""The outbox under test (test-only, shared with bench/): throwaway stores, a relay in the test's
event loop or as a ``rabbit-retry relay`` process that can be killed, and reading the table."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rabbit_retry.outbox.relay import Relay
from rabbit_retry.outbox.schema import outbox
from rabbit_retry.outbox.store import OutboxStore
from rabbit_retry.settings import Settings

from .poll import eventually, wait_for
from .process import CLI
from .stores import throwaway_postgres

# PostgreSQL runs with the newest broker only (scripts/test.sh sets RABBIT_RETRY_TEST_BROKER):
# its side does not depend on the broker's version; SQLite runs with every one.
ON_POSTGRES = os.environ.get("RABBIT_RETRY_TEST_BROKER", "4.3") == "4.3"


@contextlib.contextmanager
def outbox_store(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of a new, empty database of ``kind`` (``sqlite`` or ``postgresql``) for an
    application and its outbox."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
    else:
        with throwaway_postgres() as url:
            yield url


def migrated(url: str) -> None:
    """The outbox's tables made in the database at ``url`` (what a relay does at start)."""
    store = OutboxStore(url)
    try:
        store.migrate()
    finally:
        store.close()


def statuses(url: str) -> Counter[str]:
    """Events per status, read straight from the table."""
    engine = sa.create_engine(_sqlalchemy(url))
    try:
        with engine.connect() as c:
            return Counter({str(s): int(n) for s, n in c.execute(
                sa.select(outbox.c.status, sa.func.count()).group_by(outbox.c.status))})
    finally:
        engine.dispose()


def rows(url: str) -> list[dict[str, Any]]:
    """Every event, in id order."""
    engine = sa.create_engine(_sqlalchemy(url))
    try:
        with engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(sa.select(outbox).order_by(outbox.c.id))]
    finally:
        engine.dispose()


def _sqlalchemy(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


@contextlib.asynccontextmanager
async def relay_running(store: str, topology: Path, settings: Settings,
                        **options: Any) -> AsyncIterator[Relay]:
    """A relay in this event loop until the block ends (stopped as SIGTERM stops one)."""
    relay = Relay(store, topology, settings, **options)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: relay.metrics.heartbeat > 0 or task.done(), within=60,
                         what="the relay to start")
        if task.done():
            task.result()
        yield relay
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=120)


@dataclass
class RelayProcess:
    """``rabbit-retry relay`` as a process of its own (kill -9 tests); every start appends to
    one log."""

    settings: Settings
    topology: Path
    store: str
    log_path: Path
    extra: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> RelayProcess:
        argv = [CLI, "--url", self.settings.url_list, "relay", "--store", self.store,
                "-t", str(self.topology), *self.extra]
        before = self.log().count("relay: publishing the outbox")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=log, env={**os.environ, **(self.env or {})})
        wait_for(lambda: self.log().count("relay: publishing the outbox") > before
                 or self.exited(), "the relay to start")
        assert not self.exited(), f"the relay exited at start:\n{self.log()[-3000:]}"
        return self

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: nothing settled, nothing said."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> int:
        from .process import stop

        assert self.process is not None
        stop(self.process, grace=60)
        return int(self.process.returncode)

    def ensure_dead(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
