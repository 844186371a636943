"""The outbox under test (test-only, shared with bench/): throwaway stores, a relay in the test's
event loop or as a ``rabbit-retry relay`` process that can be killed, and reading the table."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import threading
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


def events_topology(settings: Settings, directory: Path, queue_type: str) -> Path:
    """A file with exchange ``rel`` and queue ``rel.events`` (bound to ``event.*``), applied to
    ``settings``' vhost: where the fault tests' ``Writer`` sends its events."""
    from .process import apply

    path = directory / "rel.yml"
    path.write_text("version: 1\nexchanges:\n  rel: {type: topic}\nqueues:\n  rel.events:\n"
                    f"    queue_type: {queue_type}\n"
                    '    bindings: [{exchange: rel, routing_key: "event.*"}]\n')
    apply(settings, path)
    return path


def published(url: str) -> int:
    return statuses(url)["published"]


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


# --- a stream of events, and what arrived ------------------------------------------------------

class Writer:
    """An application adding events in transactions of ``per`` from a thread: every
    ``rollback_every``-th transaction is rolled back. Event ``i`` has message id ``e-{i:06d}``,
    body ``{"seq": i, "key": ...}`` and order key ``k{i % keys}`` (every ``unkeyed_every``-th
    none). It writes ``total`` events, ``pause`` seconds between two transactions, unless
    ``stop`` ends it sooner."""

    def __init__(self, url: str, outbox: Any, total: int, *, exchange: str, routing_key: str,
                 per: int = 25, rollback_every: int = 7, keys: int = 100,
                 unkeyed_every: int = 4, pause: float = 0.0) -> None:
        self.url, self.outbox, self.total = url, outbox, total
        self.exchange, self.routing_key = exchange, routing_key
        self.per, self.rollback_every = per, rollback_every
        self.keys, self.unkeyed_every = keys, unkeyed_every
        self.pause = pause  # seconds between two transactions
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self.error: BaseException | None = None
        self._thread: Any = None
        self._stop = threading.Event()

    def key(self, i: int) -> str | None:
        return None if i % self.unkeyed_every == 0 else f"k{i % self.keys}"

    def start(self) -> Writer:
        self._thread = threading.Thread(target=self._write, name="outbox writer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End after the transaction under way, short of ``total``."""
        self._stop.set()

    def join(self, timeout: float = 600) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the writer did not finish"
        if self.error is not None:
            raise self.error

    @property
    def written(self) -> int:
        """Events in transactions that ended (committed or rolled back)."""
        return len(self.committed) + len(self.rolled_back)

    def _write(self) -> None:
        try:
            engine = sa.create_engine(_sqlalchemy(self.url))
            try:
                for n, start in enumerate(range(0, self.total, self.per)):
                    if self._stop.wait(self.pause) if self.pause else self._stop.is_set():
                        break
                    ids = []
                    with engine.connect() as conn:
                        for i in range(start, min(self.total, start + self.per)):
                            mid = f"e-{i:06d}"
                            key = self.key(i)
                            self.outbox.add(conn, exchange=self.exchange,
                                            routing_key=self.routing_key, message_id=mid,
                                            key=key, body=json.dumps({"seq": i, "key": key}))
                            ids.append(mid)
                        if n % self.rollback_every == self.rollback_every - 1:
                            conn.rollback()
                            self.rolled_back.update(ids)
                        else:
                            conn.commit()
                            self.committed.update(ids)
            finally:
                engine.dispose()
        except BaseException as exc:  # the test's thread raises it in join()
            self.error = exc


def out_of_order(bodies: list[bytes]) -> list[str]:
    """Keys whose events arrived out of order: for each key, the sequence numbers in arrival
    order, repeats of an event already seen dropped (a re-send after a kill), must rise."""
    last: dict[str, int] = {}
    seen: set[int] = set()
    wrong = []
    for body in bodies:
        event = json.loads(body)
        seq, key = int(event["seq"]), event["key"]
        if seq in seen or key is None:
            seen.add(seq)
            continue
        seen.add(seq)
        if key in last and seq < last[key]:
            wrong.append(f"{key}: {seq} after {last[key]}")
        last[key] = seq
    return wrong


def claimable(url: str) -> None:
    """Until every event in the outbox at ``url`` can be claimed. On PostgreSQL an event is
    claimed only once every transaction that began to write before it has ended (relays'
    claims aside: ``store.HORIZON``), and tests running beside this one on the same server
    hold such transactions for moments: a test that claims right after adding waits for those
    first."""
    if not url.startswith("postgresql"):
        return
    from rabbit_retry.outbox.store import HORIZON

    engine = sa.create_engine(_sqlalchemy(url))
    try:
        def ready() -> bool:
            with engine.connect() as c:
                return not c.execute(sa.text(
                    f"SELECT count(*) FROM rabbit_retry_outbox WHERE xid >= {HORIZON}")
                ).scalar_one()

        wait_for(ready, "every outbox event claimable", within=120, interval=0.05)
    finally:
        engine.dispose()


def refused_events(url: str, topology: Path, dead: Mapping[str, Mapping[str, Any]],
                   failed: Mapping[str, Mapping[str, Any]] | None = None,
                   reason: str = "unroutable: no queue is bound to 'order.lost'") -> dict[str, int]:
    """Events added to the (migrated) outbox at ``url`` through ``Outbox.add``, then refused as a
    relay would have them: those of ``dead`` (message id -> ``add``'s arguments) dead after one
    publish, those of ``failed`` failed once (tried again later). Their ids by message id."""
    from rabbit_retry.outbox import Outbox
    from rabbit_retry.outbox.decide import RetryPolicy
    from rabbit_retry.outbox.store import Failure

    adder = Outbox(topology)
    engine = sa.create_engine(_sqlalchemy(url))
    try:
        for group in (dead, failed or {}):
            with engine.begin() as conn:
                for message_id, arguments in group.items():
                    adder.add(conn, message_id=message_id, **arguments)
            claimable(url)
            store = OutboxStore(url)
            try:
                claim = store.claim(1000, on_failure="continue")
                store.settle(claim, [], [Failure(r, reason) for r in claim.rows
                                         if r.message_id in group],
                             RetryPolicy(attempts=1 if group is dead else 10), "relay-test")
            finally:
                store.close()
    finally:
        engine.dispose()
    return {str(r["message_id"]): int(r["id"]) for r in rows(url)}
