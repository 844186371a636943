"""The desk's HTTP side: the JSON API, the page's files, ``/metrics``, and who may use them.

Authentication (README, "The failure desk"):

- With a token (``RABBIT_RETRY_DESK_TOKEN``) every request needs it: API clients send
  ``Authorization: Bearer TOKEN``; the page asks for it once (``/login``) and then holds an
  HttpOnly, SameSite=Strict session cookie (an HMAC of the token, never the token itself).
- Without a token the desk only listens on loopback (the command refuses anything else).
- Every request that changes something (POST) must be JSON, must come from the desk's own origin
  when the browser says where it comes from (``Origin``), and when it is authenticated by the
  cookie rather than a bearer token must echo the ``rabbit_retry_csrf`` cookie in
  ``X-CSRF-Token`` (double submit): another site can make a browser send the cookie, not read
  it. Without a token, a bearer header or the CSRF header is still required of a browser
  (any request with an ``Origin`` or a cookie).
- Every response forbids inline scripts and framing (``Content-Security-Policy``), so nothing a
  message carries can run in the operator's browser even if the page printed it raw.

Errors are one line of JSON: ``{"error": "..."}`` with 400 (bad input), 401 (no or wrong
token), 403 (a cross-site or CSRF-less request), 404 or 409.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from rabbit_retry.desk.actions import Actions
from rabbit_retry.desk.metrics import DeskCollector
from rabbit_retry.desk.records import body_text, stored_body
from rabbit_retry.desk.schema import STATUSES
from rabbit_retry.desk.store import Query, Selection, Store
from rabbit_retry.errors import InputError
from rabbit_retry.topology import naming

SESSION_COOKIE = "rabbit_retry_desk"
CSRF_COOKIE = "rabbit_retry_csrf"
CSRF_HEADER = "X-CSRF-Token"
ACTOR_HEADER = "X-Actor"
MAX_LIMIT = 500
MAX_IDS = 10_000  # SQLite takes at most 32,766 parameters in one statement
REPLY_WAIT_S = 30.0  # a replay still running after this answers 202; the audit shows the rest
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'")
_ACTOR = re.compile(r"[^\x00-\x1f\x7f]{1,100}")


class Error(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def static_dir() -> Path:
    return Path(str(resources.files("rabbit_retry.desk") / "static"))


class Desk:
    """What the routes need: the store, the actions, the topology's queues, the token."""

    def __init__(self, store: Store, actions: Actions, queues: list[str],
                 token: str | None, ingest_stats: Any = None) -> None:
        self.store = store
        self.actions = actions
        self.queues = queues
        self.token = token
        self.ingest_stats = ingest_stats
        self.session = (
            hmac.new(token.encode(), b"rabbit-retry desk session", hashlib.sha256).hexdigest()
            if token else None
        )
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(DeskCollector(store, queues))


# --- rows as JSON ------------------------------------------------------------------------------


def _time(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def message_json(row: dict[str, Any]) -> dict[str, Any]:
    body = stored_body(row)
    out: dict[str, Any] = {
        "id": row["id"], "queue": row["queue"], "message_id": row["message_id"],
        "correlation_id": row["correlation_id"], "status": row["status"],
        "reason": row["reason"], "exception_type": row["exception_type"],
        "exception_message": row["exception_message"], "attempts": row["attempts"],
        "parked_at": _time(row["parked_at"]), "group": row["group_id"],
        "headers": row["headers"], "properties": row["properties"],
        "replay_id": row["replay_id"], "replayed_to": row["replayed_to"],
        "discard_reason": row["discard_reason"], "changed_at": _time(row["changed_at"]),
    }
    text = body_text(body)
    if text is not None:
        out["body"] = text
    else:
        out["body_base64"] = base64.b64encode(body).decode("ascii")
    return out


def _jsonable_times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _time(v) if isinstance(v, datetime) else v for k, v in row.items()}


# --- request helpers -----------------------------------------------------------------------------


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Error(400, f"{name}: not a whole number: {raw[:40]!r}") from None
    if not low <= value <= high:
        raise Error(400, f"{name}: must be between {low} and {high}, not {value}")
    return value


def _when(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise Error(400, f"{name}: not an ISO-8601 time: {raw[:40]!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _status(raw: str | None) -> str | None:
    if raw in (None, ""):
        return None
    if raw not in STATUSES:
        raise Error(400, f"status: {raw[:40]!r} is not {', '.join(STATUSES[:-1])} or "
                         f"{STATUSES[-1]}")
    return raw


async def _body(request: Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except ValueError:
        raise Error(400, "the request body is not JSON") from None
    if not isinstance(data, dict):
        raise Error(400, "the request body must be a JSON object")
    return data


def _selection(data: dict[str, Any]) -> Selection:
    ids, group = data.get("ids"), data.get("group")
    if (ids is None) == (group is None):
        raise Error(400, 'say which messages: "ids": [...] or "group": ID (one of the two)')
    if group is not None:
        if not isinstance(group, str) or not re.fullmatch(r"[0-9a-f]{16}", group):
            raise Error(400, f'"group": not a group id: {str(group)[:40]!r}')
        return Selection(group=group)
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise Error(400, '"ids": a non-empty list of message ids (numbers)')
    if len(ids) > MAX_IDS:
        raise Error(400, f'"ids": at most {MAX_IDS:,} at a time (a whole group: "group": ID)')
    return Selection(ids=tuple(ids))


def _actor(request: Request) -> str:
    raw = request.headers.get(ACTOR_HEADER, "").strip()
    if not raw:
        return "anonymous"
    if not _ACTOR.fullmatch(raw):
        raise Error(400, f"{ACTOR_HEADER}: 1 to 100 printable characters")
    return raw


# --- the app -----------------------------------------------------------------------------------


def create_app(desk: Desk) -> FastAPI:
    app = FastAPI(title="rabbit-retry desk", docs_url=None, redoc_url=None, openapi_url=None)
    store = desk.store

    @app.exception_handler(Error)
    async def _error(_r: Request, exc: Error) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(InputError)
    async def _input(_r: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"error": f"{where}: {first.get('msg', 'invalid')}"},
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.middleware("http")
    async def _guard(request: Request,
                     call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        try:
            _check(desk, request)
        except Error as exc:
            if exc.status == 401 and request.method == "GET" and request.url.path == "/":
                response: Response = RedirectResponse("/login", status_code=303)
            else:
                response = JSONResponse({"error": exc.message}, status_code=exc.status)
        else:
            response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    # --- page ---

    def _page(name: str, request: Request) -> Response:
        path = static_dir() / name
        if not path.is_file():
            raise Error(404, f"the page's {name} is not installed")
        response: Response = FileResponse(path, media_type="text/html")
        if CSRF_COOKIE not in request.cookies:
            response.set_cookie(CSRF_COOKIE, secrets.token_urlsafe(24), samesite="strict",
                                secure=request.url.scheme == "https", httponly=False)
        return response

    @app.get("/")
    async def index(request: Request) -> Response:
        return _page("index.html", request)

    @app.get("/login")
    async def login_page(request: Request) -> Response:
        if desk.token is None:
            return RedirectResponse("/", status_code=303)
        return _page("login.html", request)

    @app.post("/login")
    async def login(request: Request) -> Response:
        if desk.token is None or desk.session is None:
            return RedirectResponse("/", status_code=303)
        form = await request.form()
        given = str(form.get("token") or "")
        if not hmac.compare_digest(given.encode(), desk.token.encode()):
            return RedirectResponse("/login?failed=1", status_code=303)
        response = RedirectResponse("/", status_code=303)
        secure = request.url.scheme == "https"
        response.set_cookie(SESSION_COOKIE, desk.session, httponly=True, samesite="strict",
                            secure=secure)
        response.set_cookie(CSRF_COOKIE, secrets.token_urlsafe(24), samesite="strict",
                            secure=secure, httponly=False)
        return response

    @app.post("/logout")
    async def logout() -> Response:
        response = JSONResponse({"ok": True})
        response.delete_cookie(SESSION_COOKIE)
        return response

    if static_dir().is_dir():
        app.mount("/static", StaticFiles(directory=static_dir()), name="static")

    # --- API: reading ---

    @app.get("/api/overview")
    def overview() -> dict[str, Any]:
        by = store.parked_by()
        queues: dict[str, dict[str, Any]] = {}
        oldest: datetime | None = None
        for queue, reason, count, first in by:
            entry = queues.setdefault(queue, {"queue": queue, "parked": 0, "by_reason": {}})
            entry["parked"] += count
            entry["by_reason"][reason or "unknown"] = count
            if first is not None and (oldest is None or first < oldest):
                oldest = first
        counts = store.status_counts()
        return {
            "parked": counts.get("parked", 0), "replaying": counts.get("replaying", 0),
            "replayed": counts.get("replayed", 0), "discarded": counts.get("discarded", 0),
            "oldest_parked_at": _time(oldest), "queues": sorted(queues.values(),
                                                                 key=lambda q: q["queue"]),
            "auth": "token" if desk.token else "loopback",
            "consuming": bool(desk.ingest_stats is not None
                              and not getattr(desk.ingest_stats, "missing", None)),
        }

    @app.get("/api/queues")
    def queues() -> list[dict[str, Any]]:
        parked: dict[str, int] = {}
        for queue, _reason, count, _first in store.parked_by():
            parked[queue] = parked.get(queue, 0) + count
        return [{"queue": q, "parking_queue": naming.parking_queue(q), "parked": parked.get(q, 0)}
                for q in desk.queues]

    @app.get("/api/groups")
    def groups(request: Request) -> list[dict[str, Any]]:
        status = _status(request.query_params.get("status")) or "parked"
        rows = store.groups(request.query_params.get("queue") or None, status)
        return [_jsonable_times(r) for r in rows]

    @app.get("/api/messages")
    def messages(request: Request) -> dict[str, Any]:
        p = request.query_params
        query = Query(
            queue=p.get("queue") or None, group=p.get("group") or None,
            status=_status(p.get("status")), text=p.get("q") or None,
            since=_when(request, "since"), until=_when(request, "until"),
            limit=_int(request, "limit", 50, 1, MAX_LIMIT),
            offset=_int(request, "offset", 0, 0, 10**9),
        )
        total, rows = store.messages(query)
        return {"total": total, "items": [message_json(r) for r in rows]}

    @app.get("/api/messages/{message_id}")
    def message(message_id: str) -> dict[str, Any]:
        if not message_id.isdigit():
            raise Error(400, f"not a message id: {message_id[:40]!r}")
        row = store.message(int(message_id))
        if row is None:
            raise Error(404, f"no message {message_id}")
        return message_json(row)

    @app.get("/api/audit")
    def audit_log(request: Request) -> list[dict[str, Any]]:
        rows = store.audit(_int(request, "limit", 100, 1, MAX_LIMIT),
                           _int(request, "offset", 0, 0, 10**9))
        return [_jsonable_times(r) for r in rows]

    @app.get("/metrics")
    def metrics() -> Response:
        return PlainTextResponse(generate_latest(desk.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def health() -> dict[str, Any]:
        return {"ok": True}

    # --- API: acting ---

    @app.post("/api/replay")
    async def replay(request: Request) -> Response:
        data = await _body(request)
        selection = _selection(data)
        to, rate = data.get("to"), data.get("rate")
        if to is not None and not isinstance(to, str):
            raise Error(400, '"to": a queue name')
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
            raise Error(400, '"rate": messages per second, a number')
        task = await desk.actions.replay(selection, _actor(request), to=to,
                                         rate=float(rate) if rate is not None else None)
        done, _ = await asyncio.wait({task}, timeout=REPLY_WAIT_S)
        if done:
            result = task.result()
            body: dict[str, Any] = {"replayed": result.replayed, "replay_id": result.replay_id}
            if result.outcome:
                body["refused"] = result.refused
                body["error"] = result.outcome
            return JSONResponse(body)
        return JSONResponse({"replayed": 0, "replay_id": _running_id(desk, task),
                             "pending": True}, status_code=202)

    @app.post("/api/discard")
    async def discard(request: Request) -> dict[str, Any]:
        data = await _body(request)
        selection = _selection(data)
        reason = data.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise Error(400, '"reason": a discard needs a reason (text)')
        count = await desk.actions.discard(selection, _actor(request), reason[:1000])
        return {"discarded": count}

    return app


def _running_id(desk: Desk, task: asyncio.Task[Any]) -> str | None:
    for replay_id, running in desk.actions.running.items():
        if running is task:
            return replay_id
    return None


def _check(desk: Desk, request: Request) -> None:
    """Authentication and cross-site protection (module docstring); raises ``Error``."""
    path = request.url.path
    bearer = request.headers.get("authorization", "")
    by_bearer = False
    if desk.token is not None:
        if path in ("/login", "/healthz") or path.startswith("/static/"):
            return
        if bearer:
            scheme, _, given = bearer.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), desk.token.encode()
            ):
                raise Error(401, "wrong token (Authorization: Bearer TOKEN)")
            by_bearer = True
        else:
            cookie = request.cookies.get(SESSION_COOKIE, "")
            assert desk.session is not None
            if not hmac.compare_digest(cookie.encode(), desk.session.encode()):
                raise Error(401, "this desk needs its token (RABBIT_RETRY_DESK_TOKEN): "
                                 "Authorization: Bearer TOKEN, or log in at /login")
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise Error(403, f"cross-site request refused (Origin {origin[:80]!r})")
    if path in ("/login", "/logout"):
        return
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise Error(400, "send JSON (Content-Type: application/json)")
    if by_bearer or (desk.token is None and bearer):
        return
    browser = origin is not None or bool(request.cookies)
    if desk.token is not None or browser:
        sent = request.headers.get(CSRF_HEADER, "")
        expected = request.cookies.get(CSRF_COOKIE, "")
        if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
            raise Error(403, f"missing or wrong {CSRF_HEADER} (the page sends the "
                             f"{CSRF_COOKIE} cookie's value)")
