"""The failure desk under test: in the test's event loop, or as a ``rabbit-retry desk`` process
that can be killed, or (``running_desk``) as a process with an API client beside it for the
page's browser tests (test-only, shared with bench/)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from rabbit_retry.cli.desk import ACCESS_ENV, OUTBOX_ENV, TOKEN_ENV
from rabbit_retry.desk.auth import Access, load_access
from rabbit_retry.desk.serve import Listen, serve
from rabbit_retry.settings import Settings
from rabbit_retry.topology import Topology

from .poll import eventually, wait_for
from .process import CLI
from .stores import throwaway_postgres

TOKEN = "t0ken-for-the-desk-tests"
# Named operators for the tests: ana operates, vic only views, and Prometheus scrapes.
SECRETS = {"ana": "ana-s3cret-for-the-desk", "vic": "vic-s3cret-for-the-desk",
           "metrics": "scrape-s3cret-for-the-desk"}
ACCESS = """\
operators:
  ana: {role: operator, secret_env: DESK_TEST_ANA}
  vic: {role: viewer, secret_env: DESK_TEST_VIC}
metrics: {secret_env: DESK_TEST_METRICS}
"""
ACCESS_ENV_VALUES = {"DESK_TEST_ANA": SECRETS["ana"], "DESK_TEST_VIC": SECRETS["vic"],
                     "DESK_TEST_METRICS": SECRETS["metrics"]}


# What ``rabbit-retry desk`` prints once it listens.
LISTENING = re.compile(r"rabbit-retry desk: open http://127\.0\.0\.1:(\d+)/")


@contextlib.contextmanager
def store_url(kind: str, tmp_path: Path) -> Iterator[str]:
    """A new, empty desk store of ``kind`` (``sqlite`` or ``postgresql``)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'desk.db'}"
    else:
        with throwaway_postgres() as url:
            yield url


def access_of(text: str, tmp_path: Path, env: Mapping[str, str] | None = None) -> Access:
    """The access ``text`` (an access file's YAML) grants, with ``env`` as its environment."""
    path = tmp_path / "access.yml"
    path.write_text(text)
    return load_access(path, None, env={**ACCESS_ENV_VALUES, **(env or {})})


@contextlib.asynccontextmanager
async def desk_running(
    topology: Topology, settings: Settings, store: str, *, token: str | None = None,
    access: Access | None = None, as_user: str | None = None,
    keep: timedelta = timedelta(days=30),
) -> AsyncIterator[httpx.AsyncClient]:
    """A desk in this event loop; yields a client for it (with the token, when set, or as the
    named operator ``as_user`` of ``SECRETS``)."""
    bound: list[Listen] = []
    task = asyncio.create_task(serve(topology, settings, store_url=store,
                                     listen=Listen("127.0.0.1", 0), keep=keep, token=token,
                                     access=access, on_ready=bound.append))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    auth = (as_user, SECRETS[as_user]) if as_user else None
    try:
        await eventually(lambda: bool(bound) or task.done(), within=30, what="desk ready")
        if task.done():
            task.result()
        async with httpx.AsyncClient(base_url=bound[0].url, headers=headers, auth=auth,
                                     timeout=60) as client:
            yield client
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)


@dataclass
class DeskProcess:
    """``rabbit-retry desk`` as a process of its own (kill -9 tests)."""

    settings: Settings
    topology: Path
    store: str
    log_path: Path
    port: int = 0
    env: Mapping[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DeskProcess:
        """Start it: on the port it had (a restart), else on one the system picks (port 0; a
        port found free beforehand could be taken by another test's server before the desk
        bound it, and that server would answer this test)."""
        argv = [CLI, "--url", self.settings.url, "--management-url",
                self.settings.management_url, "desk", str(self.topology), "--store", self.store,
                "--listen", f"127.0.0.1:{self.port}"]
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=log, env={**os.environ, **(self.env or {})})
        process = self.process
        wait_for(lambda: self._listening(start) or process.poll() is not None,
                 "the desk to serve")
        assert process.poll() is None, f"the desk exited:\n{self.log()[-3000:]}"
        return self

    def _listening(self, start: int) -> bool:
        """Whether the desk printed where it listens (since ``start`` in its log): then its
        port is known and it answers."""
        with self.log_path.open("rb") as log:
            log.seek(start)
            found = LISTENING.search(log.read().decode(errors="replace"))
        if found is not None:
            self.port = int(found.group(1))
        return found is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> int:
        from .process import stop

        assert self.process is not None
        stop(self.process, grace=30)
        return int(self.process.returncode)


@dataclass
class Desk:
    """A running desk process seen as an API client: its address, its token (None: loopback
    only, no token) or the named operator it calls the API as, and its process."""

    process: DeskProcess
    token: str | None
    user: str | None = None

    @property
    def url(self) -> str:
        return self.process.url

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request as an API client (with the bearer token or the operator's secret)."""
        headers = dict(kwargs.pop("headers", {}))
        if self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        if self.user is not None and "auth" not in kwargs and "Authorization" not in headers:
            kwargs["auth"] = (self.user, SECRETS[self.user])
        try:
            return httpx.request(method, self.url + path, headers=headers, timeout=60.0,
                                 **kwargs)
        except httpx.TransportError as exc:  # say what became of the desk
            raise AssertionError(
                f"{method} {path} on {self.url}: {exc!r}; "
                f"{self.died() or 'the desk process still runs'}; its log ends:\n"
                f"{self.process.log()[-3000:]}") from exc

    def get(self, path: str, **params: Any) -> Any:
        """GET ``path`` as JSON; anything but 200 fails the test with the desk's answer."""
        response = self.api("GET", path, params=params)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text}"
        return response.json()

    def died(self) -> str | None:
        """Why to stop waiting: the process exited (with its log's tail)."""
        process = self.process.process
        if process is None or process.poll() is None:
            return None
        return f"the desk exited {process.returncode}:\n{self.process.log()[-3000:]}"


@contextlib.contextmanager
def running_desk(settings: Settings, topology: Path, workdir: Path, *,
                 token: str | None = None, access: str | None = None,
                 as_user: str = "ana", outbox: str | None = None) -> Iterator[Desk]:
    """``rabbit-retry desk TOPOLOGY`` on a free loopback port with a SQLite store in
    ``workdir``, and a token when given, or the access file ``access`` (YAML; its API client
    is the operator ``as_user``), never one from the environment otherwise; with ``outbox``,
    the application's outbox it shows (given as ``RABBIT_RETRY_OUTBOX_STORE``)."""
    env = {TOKEN_ENV: token or "", ACCESS_ENV: "", OUTBOX_ENV: outbox or ""}
    if access is not None:
        path = workdir / "access.yml"
        path.write_text(access)
        env.update(ACCESS_ENV_VALUES)
        env[ACCESS_ENV] = str(path)
    process = DeskProcess(settings, topology, f"sqlite:///{workdir / 'desk.db'}",
                          workdir / "desk.log", env=env).start()
    try:
        yield Desk(process, token, as_user if access is not None else None)
    finally:
        process.stop()
