"""The desk's web application: what its routes share (``Desk``) and the FastAPI app that serves
them (``create_app``): the edge (Host, body bound, security headers), the error answers, and
three routers: the page and its sessions, reading, acting. Every route names its guard
(``api.guard``: who the request is, what it may do) and takes a pydantic model; the work is one
store or actions call.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client.registry import CollectorRegistry

from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.api import acting, errors, pages, reading
from rabbit_retry.desk.api.edge import Edge
from rabbit_retry.desk.auth import OPERATORS, TOKEN, Access, Identity, Throttle, load_access
from rabbit_retry.desk.metrics import DeskCollector
from rabbit_retry.desk.outbox import DeskOutbox
from rabbit_retry.desk.outcomes import Depths
from rabbit_retry.desk.store import Store


def static_dir() -> Path:
    return Path(str(resources.files("rabbit_retry.desk") / "static"))


class Desk:
    """What the routes need: the store, the actions, the topology's queues, who may come in."""

    def __init__(self, store: Store, actions: Actions, queues: list[str],
                 access: Access | str | None = None, ingest_stats: Any = None,
                 depths: Depths | None = None, outbox: DeskOutbox | None = None) -> None:
        self.store = store
        # An application's outbox (``--outbox``): its failed and dead events beside the parked.
        self.outbox = outbox
        self.actions = actions
        self.queues = queues
        # A string is the quick start's token (and None the loopback mode).
        self.access = access if isinstance(access, Access) else load_access(None, access)
        self.ingest_stats = ingest_stats
        self.depths = depths
        self.key = store.session_key()
        self.throttle = Throttle()
        self.verified: dict[str, tuple[float, Identity]] = {}
        self._regrouping: asyncio.Task[int] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(DeskCollector(store, queues))

    def regroup_soon(self) -> None:
        """Regroup the stored messages under the rules as they are now, in the background."""
        if self._regrouping is None or self._regrouping.done():
            self._regrouping = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.store.regroup))

    @property
    def how_to_log_in(self) -> str:
        if self.access.mode == TOKEN:
            return ("this desk needs its token (RABBIT_RETRY_DESK_TOKEN): Authorization: Bearer "
                    "TOKEN, or log in at /login")
        if self.access.mode == OPERATORS and self.access.sessions:
            return ("who are you? Authorization: Basic NAME:SECRET (curl -u), or log in at "
                    "/login")
        if self.access.mode == OPERATORS:
            return "who are you? this desk lets in whom its authenticating proxy names"
        return "not allowed"

    @property
    def hosts(self) -> frozenset[str]:
        return self.access.hosts


def create_app(desk: Desk, *, listen_host: str | None = None) -> Any:
    """The ASGI application of ``desk`` (FastAPI inside the edge)."""
    app = FastAPI(title="rabbit-retry failure desk", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.desk = desk
    errors.install(app)
    app.include_router(pages.router)
    app.include_router(reading.router)
    app.include_router(acting.router)
    pages.mount_static(app, static_dir())
    hosts = set(desk.hosts)
    if listen_host:
        hosts.add(listen_host.lower())
    return Edge(app, frozenset(hosts))
