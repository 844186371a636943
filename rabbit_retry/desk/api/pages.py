"""The page and its sessions: ``/`` (the page, or the login form when a secret is needed),
``/login`` (a new random session per login, signed, expiring; failures throttled and logged),
``/logout`` (the session ends, in the store: its cookie is worth nothing after), ``/api/me``."""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from rabbit_retry.desk.api.errors import ApiError
from rabbit_retry.desk.api.guard import (
    CSRF_COOKIE,
    SESSION_COOKIE,
    Who,
    address,
    check_origin,
    check_secret,
    desk_of,
    session_of,
    start_session,
    who,
)
from rabbit_retry.desk.auth import LOOPBACK, TOKEN, session_key_of
from rabbit_retry.desk.errors import TooMany

log = logging.getLogger("rabbit_retry.desk")
router = APIRouter()
FORM_MAX = 4096


def mount_static(app: FastAPI, directory: Path) -> None:
    if directory.is_dir():
        app.mount("/static", StaticFiles(directory=directory), name="static")


def _page(request: Request, name: str) -> Response:
    from rabbit_retry.desk.app import static_dir

    path = static_dir() / name
    if not path.is_file():
        raise ApiError(404, f"the page's {name} is not installed")
    response: Response = FileResponse(path, media_type="text/html")
    if CSRF_COOKIE not in request.cookies and getattr(request.state, "session_id", None) is None:
        # Double-submit for the modes without a session (loopback, proxy).
        response.set_cookie(CSRF_COOKIE, secrets.token_urlsafe(24), samesite="strict",
                            secure=request.url.scheme == "https", httponly=False)
    return response


@router.get("/", include_in_schema=False)
async def index(request: Request) -> Response:
    try:
        await who(request)
    except ApiError as exc:
        if exc.status == 401 and desk_of(request).access.sessions:
            return RedirectResponse("/login", status_code=303)
        raise
    return _page(request, "index.html")


@router.get("/login", include_in_schema=False)
async def login_page(request: Request) -> Response:
    if not desk_of(request).access.sessions:
        return RedirectResponse("/", status_code=303)
    return _page(request, "login.html")


@router.get("/login/mode", include_in_schema=False)
def login_mode(request: Request) -> dict[str, Any]:
    """Whether the login form asks for a name (named operators) or the token only."""
    return {"mode": desk_of(request).access.mode}


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    desk = desk_of(request)
    if not desk.access.sessions:
        return RedirectResponse("/", status_code=303)
    check_origin(request)
    form = await request.form(max_fields=4, max_files=0, max_part_size=FORM_MAX)
    name = str(form.get("name") or "").strip() or None
    secret = str(form.get("secret") or form.get("token") or "")
    if desk.access.mode == TOKEN:
        name = None
    elif name is None:
        return RedirectResponse("/login?failed=name", status_code=303)
    try:
        identity = await check_secret(desk, request, name, secret)
    except TooMany as exc:
        return RedirectResponse(f"/login?failed=throttled&wait={max(1, round(exc.retry_after))}",
                                status_code=303)
    if identity is None or not identity.may_read:
        return RedirectResponse("/login?failed=1", status_code=303)
    cookie, csrf, lifetime = await asyncio.to_thread(start_session, desk, identity)
    log.info("desk: %s logged in from %s (%s)", identity.name, address(request) or "?",
             identity.role)
    response = RedirectResponse("/", status_code=303)
    secure = request.url.scheme == "https"
    seconds = int(lifetime.total_seconds())
    response.set_cookie(SESSION_COOKIE, cookie, httponly=True, samesite="strict",
                        secure=secure, max_age=seconds)
    response.set_cookie(CSRF_COOKIE, csrf, samesite="strict", secure=secure, httponly=False,
                        max_age=seconds)
    return response


@router.post("/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    check_origin(request)
    desk = desk_of(request)
    session = await asyncio.to_thread(session_of, desk, request)
    if session is not None:
        await asyncio.to_thread(desk.store.end_session, session_key_of(session[0]))
        log.info("desk: %s logged out", session[1].name)
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE)
    response.delete_cookie(CSRF_COOKIE)
    return response


@router.get("/api/me")
async def me(request: Request, identity: Who) -> dict[str, Any]:
    """Who the page is acting as, and what it may do."""
    desk = desk_of(request)
    return {"name": identity.name, "role": identity.role, "mode": desk.access.mode,
            "may_act": identity.may_act,
            "logout": getattr(request.state, "session_id", None) is not None,
            "loopback": desk.access.mode == LOOPBACK, "outbox": desk.outbox is not None}


@router.get("/favicon.ico", include_in_schema=False)
def favicon() -> Response:
    from rabbit_retry.desk.app import static_dir

    return FileResponse(static_dir() / "favicon.svg", media_type="image/svg+xml")


@router.get("/healthz", include_in_schema=False)
def health() -> dict[str, Any]:
    return {"ok": True}
