"""The failure desk (``rabbit-retry desk``) as a separate process for the browser tests
(test-only): started on a free loopback port against a test's vhost and its own store, ready
once its JSON API answers, stopped with SIGTERM; and its API, for a test's own checks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rabbit_retry.settings import Settings

from .poll import wait_for
from .process import CLI, stop

TOKEN_ENV = "RABBIT_RETRY_DESK_TOKEN"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Desk:
    """A running desk: its address, its token (None: loopback only) and its log."""

    url: str
    token: str | None
    process: subprocess.Popen[bytes]
    log: Path

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request to the desk as an API client (the bearer token when there is one)."""
        headers = dict(kwargs.pop("headers", {}))
        if self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        return httpx.request(method, self.url + path, headers=headers, timeout=30.0, **kwargs)

    def get(self, path: str, **params: Any) -> Any:
        """GET ``path`` as JSON; anything but 200 fails the test with the desk's answer."""
        response = self.api("GET", path, params=params)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text}"
        return response.json()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def died(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"the desk exited {code}:\n{self.output()[-4000:]}"


@contextlib.contextmanager
def running_desk(settings: Settings, topology: Path, workdir: Path, *, token: str | None = None,
                 env: Mapping[str, str] | None = None) -> Iterator[Desk]:
    """``rabbit-retry desk TOPOLOGY`` on a free port with a SQLite store in ``workdir``."""
    port = free_port()
    log = workdir / f"desk-{port}.log"
    environment = {**os.environ, **(env or {})}
    environment.pop(TOKEN_ENV, None)
    if token is not None:
        environment[TOKEN_ENV] = token
    argv = [CLI, "--url", settings.url, "--management-url", settings.management_url, "desk",
            str(topology), "--store", f"sqlite:///{workdir / 'desk.db'}",
            "--listen", f"127.0.0.1:{port}"]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, env=environment)
    desk = Desk(f"http://127.0.0.1:{port}", token, process, log)
    try:
        wait_for(lambda: _answers(desk), "the desk's API to answer", unless=desk.died)
        yield desk
    finally:
        stop(process)


def _answers(desk: Desk) -> bool:
    try:
        return desk.api("GET", "/api/overview").status_code == 200
    except httpx.TransportError:
        return False
