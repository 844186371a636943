"""``rabbit-retry desk``: the store migrated, the parking queues ingested, the page and API
served, replays left unfinished by a stopped desk finished, stored messages regrouped when the
grouping rules change, old rows and sessions swept; until a signal."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.auth import LOOPBACK, Access, load_access
from rabbit_retry.desk.ingest import Ingest
from rabbit_retry.desk.outbox import DeskOutbox
from rabbit_retry.desk.outcomes import Depths
from rabbit_retry.desk.store import Store
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings, shown
from rabbit_retry.topology import Topology

log = logging.getLogger("rabbit_retry.desk")

DEFAULT_LISTEN = "127.0.0.1:8025"
ADOPT_EVERY_S = 10.0  # how often a desk looks for replays another desk left unfinished
SWEEP_EVERY_S = 3600.0


@dataclass(frozen=True)
class Listen:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def parse_listen(value: str) -> Listen:
    """``HOST:PORT`` (``[::1]:8025`` for IPv6); port 0: one the system picks, printed once the
    desk listens."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InputError(f"--listen {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return Listen(host.strip("[]"), int(port))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(listen: Listen, access: Access) -> None:
    """Without credentials the desk serves loopback only: anyone who reaches it could replay."""
    if access.mode == LOOPBACK and not is_loopback(listen.host):
        raise InputError(
            f"--listen {listen.host}:{listen.port}: without RABBIT_RETRY_DESK_TOKEN or --access "
            "FILE the desk listens on loopback only (127.0.0.1, ::1); set one to listen "
            "elsewhere"
        )


def open_store(url: str) -> Store:
    store = Store(url)
    try:
        store.migrate()
    except InputError:
        raise
    except Exception as exc:
        store.close()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BrokerError(f"store {shown(url)}: cannot open or migrate it: {first}") from None
    return store


def open_outbox(url: str) -> DeskOutbox:
    """The application's outbox at ``url``, checked: its tables at the revision the desk reads
    (the desk never creates or migrates them)."""
    outbox = DeskOutbox(url)
    try:
        outbox.check()
    except BaseException:
        outbox.close()
        raise
    return outbox


async def serve(topology: Topology, settings: Settings, *, store_url: str, listen: Listen,
                keep: timedelta, token: str | None = None, access: Access | None = None,
                on_ready: Callable[[Listen], None] | None = None,
                outbox_url: str | None = None) -> None:
    """Serve until stopped; ``on_ready`` is told where it listens (the system's port for 0)."""
    import uvicorn

    from rabbit_retry.desk.app import Desk, create_app

    access = access if access is not None else load_access(None, token)
    check_exposure(listen, access)
    outbox = await asyncio.to_thread(open_outbox, outbox_url) if outbox_url else None
    try:
        store = await asyncio.to_thread(open_store, store_url)
    except BaseException:
        if outbox is not None:
            outbox.close()
        raise
    queues = list(topology.queue_names)
    ingest = Ingest(store, settings, queues)
    actions = Actions(store, settings, set(queues))
    desk = Desk(store, actions, queues, access, ingest.stats, Depths(settings, topology),
                outbox=outbox)
    config = uvicorn.Config(create_app(desk, listen_host=listen.host), host=listen.host,
                            port=listen.port, log_level="warning", access_log=False,
                            lifespan="off")

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Ours below: uvicorn's would re-raise the signal after shutting down, killing the
            # process before the desk closes its store and connections.
            yield

    server = Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop, server)
    background = [asyncio.create_task(ingest.run(), name="ingest"),
                  asyncio.create_task(_housekeeping(store, actions, keep), name="housekeeping")]
    serving = asyncio.create_task(server.serve(), name="http")
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise BrokerError(f"cannot listen on {listen.host}:{listen.port}")
            await asyncio.sleep(0.05)
        listen = _bound(server, listen)
        auth = {"loopback": "loopback only, no sign-in", "token": "a token is required",
                "operators": "named operators sign in"}[access.mode]
        log.info("desk: serving %s (%s); store %s; %d queue(s)%s", listen.url, auth,
                 shown(store_url), len(queues),
                 f"; outbox {outbox.name}" if outbox is not None else "")
        print(f"rabbit-retry desk: open {listen.url} ({auth})", flush=True)
        if on_ready is not None:
            on_ready(listen)
        await serving
    finally:
        server.should_exit = True
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        with suppress(Exception):
            await asyncio.wait_for(serving, timeout=5)
        await actions.close()
        store.close()
        if outbox is not None:
            outbox.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if not serving.cancelled() and serving.exception() is not None:
        raise BrokerError(f"cannot listen on {listen.host}:{listen.port}")


def _bound(server: Any, listen: Listen) -> Listen:
    """Where ``server`` listens: ``listen`` with the port the system gave for port 0."""
    if listen.port:
        return listen
    port = server.servers[0].sockets[0].getsockname()[1]
    return Listen(listen.host, int(port))


def _stop(server: Any) -> None:
    if server.should_exit:  # a second signal: stop now
        server.force_exit = True
    server.should_exit = True


async def _housekeeping(store: Store, actions: Actions, keep: timedelta) -> None:
    """Finish replays whose desk stopped; send the releases of ordered keys not sent yet; regroup
    messages grouped under older rules; delete rows older than ``keep`` once replayed or
    discarded, and expired sessions."""
    swept_at = -SWEEP_EVERY_S
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        try:
            await actions.adopt_abandoned()
            await actions.send_releases()
            moved = await asyncio.to_thread(store.regroup)
            if moved:
                log.info("desk: %d stored messages moved to another group (grouping rules "
                         "changed)", moved)
            if loop.time() - swept_at >= SWEEP_EVERY_S:
                removed = await asyncio.to_thread(store.sweep, keep)
                swept_at = loop.time()
                if removed:
                    log.info("desk: removed %d replayed or discarded messages older than %s",
                             removed, keep)
            if failing:
                log.info("desk: housekeeping works again")
            failing = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the store is down: the next round tries again
            if not failing:  # once per outage, not every round
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("desk: housekeeping failed (%s); trying again every %.0fs",
                            first, ADOPT_EVERY_S)
            failing = True
        await asyncio.sleep(ADOPT_EVERY_S)
