"""Throwaway vhosts on the broker under test, and the other changes only tests make through the
management API (test-only, shared with bench/): the product never creates or deletes a vhost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings

# Long, for a broker short of file handles: RabbitMQ starts a new vhost's message stores only
# once its file handle cache has room, so with many vhosts alive (other test sessions) a create
# can wait for a while and then succeed; and deleting a vhost with many quorum queues can outlast
# one HTTP request.
TIMEOUT_S = 180.0


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(p, safe="") for p in parts)


def _ok(response: httpx.Response, method: str, path: str) -> None:
    assert response.status_code < 400, (
        f"management API {method} {path}: {response.status_code} {response.text[:300]}"
    )


def create_vhost(api: Management, name: str, user: str) -> None:
    """The vhost ``name``, with every permission on it for ``user``."""
    path = _path("vhosts", name)
    _ok(api.request("PUT", path), "PUT", path)
    path = _path("permissions", name, user)
    _ok(api.request("PUT", path, json={"configure": ".*", "write": ".*", "read": ".*"}),
        "PUT", path)


def delete_vhost(api: Management, name: str, *, within: float = TIMEOUT_S) -> None:
    """Deletes ``name`` and waits until the broker no longer lists it (a 404 on a retry does not
    mean the first deletion has finished), trying again while the broker does not answer (a
    benchmark's broker may be restarting). Raises what failed last after ``within`` seconds."""
    deadline = time.monotonic() + within
    path = _path("vhosts", name)
    while True:
        try:
            response = api.request("DELETE", path)
            if response.status_code != 404:
                _ok(response, "DELETE", path)
            if not api.vhost_exists(name):
                return
            failure: Exception = AssertionError(f"vhost {name!r} still listed after its deletion")
        except (BrokerError, AssertionError) as exc:
            failure = exc
        if time.monotonic() > deadline:
            raise failure
        time.sleep(1)


@contextlib.contextmanager
def throwaway_vhost(base: Settings, name: str) -> Iterator[Settings]:
    """``base`` on a new vhost ``name``, deleted on the way out whatever happened inside."""
    with Management(base.management_url, timeout=TIMEOUT_S) as api:
        try:
            # Inside the try: a create that timed out on our side may still have happened.
            create_vhost(api, name, base.user)
            yield base.for_vhost(name)
        finally:
            delete_vhost(api, name)


def import_definitions(api: Management, vhost: str, definitions: dict[str, Any]) -> None:
    """Loads exported ``definitions`` into ``vhost`` (what an operator does with ``export``)."""
    path = _path("definitions", vhost)
    _ok(api.request("POST", path, json=definitions), "POST", path)
