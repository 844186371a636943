"""What every request meets before any route, in every mode: its ``Host`` must name this desk
(a page on another site that rebinds its own name to the desk's address gets 400, and with it
no cookie and no answer), its body is bounded (413), and every response forbids inline
scripts, framing and sniffing (``Content-Security-Policy``: nothing a message carries can run in
the operator's browser even if the page printed it raw)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rabbit_retry.desk.auth import host_allowed, host_name

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_MAX = 4 * 2**20  # an edited body is the largest thing a client sends
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'")
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # same-origin: a form the page posts carries its Origin (no-referrer would send "null")
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]


class Edge:
    def __init__(self, app: App, hosts: frozenset[str], body_max: int = BODY_MAX) -> None:
        self.app = app
        self.hosts = hosts
        self.body_max = body_max

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if not host_allowed(host, self.hosts):
            shown = host_name(host or "")[:80] or "(none)"
            await _answer(send, 400, f"Host {shown!r} is not a name of this desk (an address, "
                                     "localhost, or one listed in RABBIT_RETRY_DESK_HOSTS or "
                                     "the access file's hosts:)")
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.body_max):
            await _answer(send, 413, f"the request body is larger than {self.body_max:,} bytes")
            return
        # The body is read here, whole and bounded, before any route sees it (at most
        # ``body_max`` bytes are ever held), then handed on as it came.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.body_max:
                await _answer(send, 413, f"the request body is larger than "
                                         f"{self.body_max:,} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                   "more_body": False}]

        async def replayed() -> Message:
            return pending.pop() if pending else await receive()

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in present]
                if b"cache-control" not in present:
                    extra.append((b"cache-control", b"no-store"))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, replayed, secured)


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *HEADERS,
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})
