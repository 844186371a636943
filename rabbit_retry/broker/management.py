"""A small client for RabbitMQ's HTTP management API (read live state, admin a vhost), of one
node or the first of a cluster's nodes that answers."""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urlunsplit

import httpx

from rabbit_retry.backoff import Backoff
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings, mask, parse_url
from rabbit_retry.tls import describe_tls_error, tls_cause


def _q(name: str) -> str:
    return quote(name, safe="")


# What the user lacks, by the management API's reason for a 401 (README, "Who may run what").
_HINTS = {
    "Not management user": "; it needs the management or monitoring tag",
    "User not authorised to access virtual host": "; it needs permissions on the vhost",
}
# Tags whose users see every vhost in ``GET /api/vhosts``, not only their own.
_SEE_ALL_VHOSTS = frozenset({"administrator", "monitoring"})
# Times a GET the broker answered with a server error (5xx) is asked again.
GET_AGAIN = 2


class Management:
    """Synchronous management API client; every failure is a one-line ``BrokerError``.

    Given several URLs (the nodes of one cluster), it uses the first that answers and moves to
    the next when a request cannot reach its node; every node's API shows the whole cluster.
    """

    def __init__(
        self,
        management_url: str | Sequence[str],
        timeout: float = 30.0,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        urls = [management_url] if isinstance(management_url, str) else list(management_url)
        if not urls:
            raise InputError("--management-url: no URL given")
        self._nodes = [self._client_for(url, timeout, tls) for url in urls]
        self._current = 0
        self._tags: frozenset[str] | None = None

    def _client_for(
        self, management_url: str, timeout: float, tls: ssl.SSLContext | None
    ) -> tuple[str, str, httpx.Client]:
        """(printable base URL, user, client) of one node's API."""
        parts = parse_url(management_url, "--management-url", ("http", "https"))
        if not parts.host:
            raise InputError(
                f"--management-url: expected http(s)://user:pass@host:port, got {parts.shown!r}"
            )
        # Basic auth takes the user and password as the broker knows them: decoded.
        auth = (parts.user or "guest", parts.password or "guest")
        host = f"[{parts.host}]" if ":" in parts.host else parts.host
        netloc = host + (f":{parts.port}" if parts.port else "")
        base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        client = httpx.Client(
            base_url=base + "/api",
            auth=auth,
            timeout=timeout,
            verify=tls if tls is not None else True,
        )
        return base, auth[0], client

    @property
    def safe_url(self) -> str:
        """The node in use, without credentials."""
        return self._nodes[self._current][0]

    @property
    def _user(self) -> str:
        return self._nodes[self._current][1]

    @property
    def _client(self) -> httpx.Client:
        return self._nodes[self._current][2]

    @classmethod
    def for_settings(cls, settings: Settings, timeout: float = 30.0) -> Self:
        """The management API of ``settings``, verified with its TLS files when https."""
        return cls(settings.management_urls, timeout, tls=settings.management_tls())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for _, _, client in self._nodes:
            client.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        first = self._current
        while True:
            try:
                return self._request(method, path, **kwargs)
            except BrokerError as exc:
                if not self._next_node(first, method, exc.__cause__):
                    raise

    def _next_node(self, first: int, method: str, cause: BaseException | None) -> bool:
        """Moves to the next node after a request that could not reach this one; False when
        every node was tried, or the request may have had its effect (only a GET, or a request
        that never connected, is sent again)."""
        if len(self._nodes) == 1 or not isinstance(cause, httpx.TransportError):
            return False
        never_sent = isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout)
        if method != "GET" and not never_sent:
            return False
        following = (self._current + 1) % len(self._nodes)
        if following == first:
            return False
        self._current = following
        return True

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            tls_error = tls_cause(exc)
            if tls_error is not None:
                raise BrokerError(
                    f"TLS handshake with management API at {self.safe_url} failed: "
                    f"{mask(describe_tls_error(tls_error))}"
                ) from exc
            raise BrokerError(
                f"management API at {self.safe_url} unreachable ({type(exc).__name__}: "
                f"{mask(str(exc)) or 'no detail'}); is the rabbitmq_management plugin enabled?"
            ) from exc
        if response.status_code == 401:
            raise Refused(self._refusal(response))
        return response

    def _refusal(self, response: httpx.Response) -> str:
        """A 401 in one line: wrong credentials, or a user the API does not admit."""
        try:
            reason = str(response.json().get("reason") or "")
        except (ValueError, AttributeError):
            reason = ""
        # Wrong credentials: "Login failed" on 3.x, "Not_Authorized" on 4.x.
        if reason and reason not in ("Login failed", "Not_Authorized"):
            # The password was right; the user lacks a tag or a permission the API asks for.
            hint = _HINTS.get(reason, "")
            return (
                f"management API at {self.safe_url} refused user {self._user!r}: {mask(reason)}"
                f" (401){hint}"
            )
        return f"management API at {self.safe_url} refused the credentials (401)"

    def get(self, path: str, **params: Any) -> Any:
        """``path``'s JSON. A server error is asked again (``GET_AGAIN`` times, a moment
        apart): RabbitMQ 4.0 answered ``GET /vhosts`` with a bare 500 while another vhost was
        being deleted (a CI run, many vhosts made and deleted side by side)."""
        backoff = Backoff(0.2, 1.0)
        while True:
            response = self.request("GET", path, params=params or None)
            if response.status_code < 500 or backoff.failures >= GET_AGAIN:
                break
            time.sleep(backoff.failed())
        if response.status_code == 404:
            raise NotFound(path)
        self._raise_for(response, "GET", path)
        return response.json()

    def _raise_for(self, response: httpx.Response, method: str, path: str) -> None:
        if response.status_code >= 400:
            try:
                reason = response.json().get("reason", response.text)
            except ValueError:
                reason = response.text
            raise BrokerError(
                f"management API {method} {path} failed: {response.status_code} {reason}"
            )

    # --- vhosts -------------------------------------------------------------------------------

    # ``GET /api/vhosts/{vhost}`` is for administrators alone; the list is for every user of
    # the API (a management or policymaker user sees the vhosts it has permissions on).

    def vhost_exists(self, vhost: str) -> bool:
        """Whether ``vhost`` exists and this user may see it."""
        listed = self.get("/vhosts", columns="name")
        return any(isinstance(v, dict) and v.get("name") == vhost for v in listed)

    def require_vhost(self, vhost: str) -> None:
        if self.vhost_exists(vhost):
            return
        if self.tags() & _SEE_ALL_VHOSTS:
            raise BrokerError(f"vhost {vhost!r} does not exist on the broker")
        raise BrokerError(
            f"vhost {vhost!r} does not exist on the broker, or user {self._user!r} has no "
            "permissions on it"
        )

    def tags(self) -> frozenset[str]:
        """The tags of the user the API knows us as (``GET /api/whoami``), read once."""
        if self._tags is None:
            raw = self.get("/whoami").get("tags") or ()
            # 3.x gives one comma-separated string, 4.x a list.
            names = raw.split(",") if isinstance(raw, str) else raw
            self._tags = frozenset(str(t).strip() for t in names if str(t).strip())
        return self._tags

    @property
    def user(self) -> str:
        """The user the API knows us as (decoded)."""
        return self._user

    def may(self, tag: str) -> bool:
        """Whether this user has ``tag`` (an administrator has every tag's rights)."""
        return bool(self.tags() & {tag, "administrator"})

    # --- objects ------------------------------------------------------------------------------

    def overview(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/overview")
        return result

    def queues(self, vhost: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get(f"/queues/{_q(vhost)}")
        return result

    def queue(self, vhost: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.get(f"/queues/{_q(vhost)}/{_q(name)}")
        except NotFound:
            return None
        return result

    def exchanges(self, vhost: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get(f"/exchanges/{_q(vhost)}")
        return result

    def bindings(self, vhost: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get(f"/bindings/{_q(vhost)}")
        return result

    def definitions(self, vhost: str) -> dict[str, Any]:
        result: dict[str, Any] = self.get(f"/definitions/{_q(vhost)}")
        return result

    def connections(self, vhost: str | None = None) -> list[dict[str, Any]]:
        path = f"/vhosts/{_q(vhost)}/connections" if vhost else "/connections"
        result: list[dict[str, Any]] = self.get(path)
        return result

    def close_connection(self, name: str, reason: str = "closed by rabbit-retry") -> None:
        path = f"/connections/{_q(name)}"
        response = self.request("DELETE", path, headers={"X-Reason": reason})
        if response.status_code != 404:
            self._raise_for(response, "DELETE", path)


class Refused(BrokerError):
    """The management API refused this user the request (401): wrong credentials, or a tag or
    permission it lacks."""


class NotFound(Exception):
    """A management API object that does not exist (404)."""
