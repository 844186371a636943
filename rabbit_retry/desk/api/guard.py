"""Who a request is (``who``) and what it may do (``reader``, ``actor``, ``scraper``): the
``Depends`` every route names. The identity comes from, in this order: an ``Authorization``
header (``Bearer TOKEN`` in token mode, the metrics secret; ``Basic NAME:SECRET`` for a named
operator), the trusted proxy's header (only from its addresses), the page's session cookie, or
the loopback mode. ``X-Actor`` and anything else a client says about itself count for nothing.

A request that changes something and was not authenticated by an ``Authorization`` header (a
browser's: session, proxy, loopback) must be JSON, must come from the desk's own origin when the
browser names one, and must echo the page's CSRF token in ``X-CSRF-Token``: another site can
make a browser send cookies, never read them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from rabbit_retry.desk.api.errors import ApiError
from rabbit_retry.desk.auth import (
    LOOPBACK,
    METRICS,
    OPERATOR,
    Identity,
    csrf_for,
    new_session_id,
    session_key_of,
    sign,
    unsign,
)
from rabbit_retry.desk.errors import TooMany

if TYPE_CHECKING:
    from rabbit_retry.desk.app import Desk

log = logging.getLogger("rabbit_retry.desk")

SESSION_COOKIE = "rabbit_retry_desk"
CSRF_COOKIE = "rabbit_retry_csrf"
CSRF_HEADER = "X-CSRF-Token"
VERIFIED_TTL_S = 60.0  # a checked NAME:SECRET is not hashed again for this long


def desk_of(request: Request) -> Desk:
    desk: Desk = request.app.state.desk
    return desk


def address(request: Request) -> str:
    return request.client.host if request.client else ""


def _throttled(desk: Desk, keys: list[tuple[str, str]]) -> None:
    wait = desk.throttle.refused_for(keys)
    if wait > 0:
        raise TooMany(f"too many failed logins; try again in {max(1, round(wait))} s", wait)


def failed_login(desk: Desk, request: Request, name: str | None, how: str) -> None:
    keys = [("address", address(request))] + ([("name", name)] if name else [])
    desk.throttle.failed(keys)
    log.warning("desk: failed login (%s) from %s%s", how, address(request) or "?",
                f" as {name[:64]!r}" if name else "")


def login_keys(request: Request, name: str | None) -> list[tuple[str, str]]:
    return [("address", address(request))] + ([("name", name)] if name else [])


async def check_secret(desk: Desk, request: Request, name: str | None,
                       secret: str) -> Identity | None:
    """The identity ``name`` and ``secret`` (a token when ``name`` is None) prove; throttled
    and logged. ``TooMany`` while the address or name is refused."""
    keys = login_keys(request, name)
    _throttled(desk, keys)
    cache_key = hashlib.sha256(f"{name}\0{secret}".encode()).hexdigest()
    cached = desk.verified.get(cache_key)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    access = desk.access
    if name is None:
        identity = access.by_token(secret) or access.by_metrics(secret)
    elif name == METRICS:
        identity = access.by_metrics(secret)
    else:
        identity = await asyncio.to_thread(access.operator, name, secret)
    if identity is None:
        failed_login(desk, request, name, "wrong secret")
        return None
    desk.throttle.succeeded(keys)
    if len(desk.verified) > 10_000:
        desk.verified.clear()
    desk.verified[cache_key] = (time.monotonic() + VERIFIED_TTL_S, identity)
    return identity


async def _by_header(desk: Desk, request: Request, header: str) -> Identity:
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        identity = await check_secret(desk, request, None, value)
    elif scheme.lower() == "basic" and value:
        try:
            name, colon, secret = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise ApiError(401, "Authorization: Basic needs base64 of NAME:SECRET") from None
        if not colon:
            raise ApiError(401, "Authorization: Basic needs base64 of NAME:SECRET")
        identity = await check_secret(desk, request, name, secret)
    else:
        raise ApiError(401, "Authorization: Bearer TOKEN, or Basic NAME:SECRET")
    if identity is None:
        raise ApiError(401, "wrong credentials (Authorization)")
    return identity


def session_of(desk: Desk, request: Request) -> tuple[str, Identity] | None:
    """(session id, identity) of the request's session cookie, when it is live."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return None
    session_id = unsign(cookie, desk.key)
    if session_id is None:
        return None
    row = desk.store.session(session_key_of(session_id))
    if row is None:
        return None
    identity = Identity(row["identity"], row["role"], row["how"])
    if row["credential"] != desk.access.fingerprint(identity):
        return None  # the secret (or the token, or the role) changed since this login
    return session_id, identity


async def who(request: Request) -> Identity:
    """The request's identity; 401 when it has none (and 429 while its logins are refused)."""
    known: Identity | None = getattr(request.state, "identity", None)
    if known is not None:
        return known
    desk = desk_of(request)
    access = desk.access
    identity: Identity | None = None
    header = request.headers.get("authorization")
    if header:
        identity = await _by_header(desk, request, header)
        request.state.by_header = True
    elif access.proxy is not None and (
            proxied := access.by_proxy(address(request),
                                       request.headers.get(access.proxy.header))) is not None:
        identity = proxied
    elif (session := await asyncio.to_thread(session_of, desk, request)) is not None:
        request.state.session_id, identity = session
    elif access.mode == LOOPBACK:
        identity = Identity(LOOPBACK, OPERATOR, LOOPBACK)
    if identity is None:
        raise ApiError(401, desk.how_to_log_in)
    request.state.identity = identity
    return identity


Who = Annotated[Identity, Depends(who)]


def reader(identity: Who) -> Identity:
    if not identity.may_read:
        raise ApiError(403, f"{identity.name} may read /metrics only")
    return identity


def scraper(identity: Who) -> Identity:
    return identity  # anyone known: the metrics credential, a viewer, an operator


async def actor(request: Request, identity: Who) -> Identity:
    """An identity that may change something, on a request that is not forged."""
    if not identity.may_act:
        raise ApiError(403, f"{identity.name} is a {identity.role}: replay, discard, restore and "
                            "edit need the operator role")
    check_browser_post(request)
    return identity


def check_origin(request: Request) -> None:
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        raise ApiError(403, f"cross-site request refused (Origin {origin[:80]!r})")


def check_browser_post(request: Request) -> None:
    """JSON, from this origin, and (unless authenticated by a header) with the CSRF token."""
    check_origin(request)
    if request.method == "POST" and (
            request.headers.get("content-type", "").split(";")[0].strip() != "application/json"):
        raise ApiError(400, "send JSON (Content-Type: application/json)")
    if getattr(request.state, "by_header", False):
        return
    identity: Identity = request.state.identity
    desk = desk_of(request)
    session_id: str | None = getattr(request.state, "session_id", None)
    if identity.how == LOOPBACK and "origin" not in request.headers and not request.cookies:
        return  # a script on this machine, not a browser
    expected = (csrf_for(session_id, desk.key) if session_id is not None
                else request.cookies.get(CSRF_COOKIE, ""))
    sent = request.headers.get(CSRF_HEADER, "")
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise ApiError(403, f"missing or wrong {CSRF_HEADER} (the page sends the "
                            f"{CSRF_COOKIE} cookie's value)")


Reader = Annotated[Identity, Depends(reader)]
Actor = Annotated[Identity, Depends(actor)]
Scraper = Annotated[Identity, Depends(scraper)]


def start_session(desk: Desk, identity: Identity) -> tuple[str, str, timedelta]:
    """A new session for ``identity``: (cookie value, CSRF token, lifetime)."""
    session_id = new_session_id()
    lifetime = timedelta(hours=desk.access.session_hours)
    desk.store.add_session(session_key_of(session_id), identity.name, identity.role, "session",
                           desk.access.fingerprint(identity), lifetime)
    return sign(session_id, desk.key), csrf_for(session_id, desk.key), lifetime
