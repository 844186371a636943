"""Every refusal as one line of JSON, ``{"error": "..."}``, with its status: bad input 400 (a
body too large 413), who are you 401, not yours 403, not there 404, nothing to act on 409, too
many failed logins 429. Never a 5xx for anything a client sent."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rabbit_retry.desk.errors import DeskError, TooMany
from rabbit_retry.errors import BrokerError, InputError


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def one_line(text: str, limit: int = 300) -> str:
    first = " ".join(text.split())
    return first if len(first) <= limit else first[: limit - 1] + "…"


def refusal(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


_NOUNS = {"row_id": "message id", "group_id": "group id", "replay_id": "replay id",
          "rule_id": "rule id", "group": "group id"}


def _where(loc: tuple[Any, ...]) -> str:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 42 else text[:40] + "…"


_BOUNDS = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
           "greater_than": ("above", "gt"), "less_than": ("below", "lt")}
# What a field must be, per pydantic error type: from the input given, the error's context and
# the field's name.
_Describe = Callable[[Any, Mapping[str, Any], str], str]
_WHAT: dict[str, _Describe] = {
    "missing": lambda given, ctx, field: "required",
    "extra_forbidden": lambda given, ctx, field: "unknown field",
    "literal_error": lambda given, ctx, field:
        f"{_shown(given)} is not {ctx.get('expected', 'allowed')}",
    "string_pattern_mismatch": lambda given, ctx, field:
        f"not a {_NOUNS.get(field, 'valid value')}: {_shown(given)}",
    "list_type": lambda given, ctx, field: f"a list, not {_shown(given)}",
    "too_long": lambda given, ctx, field: f"at most {ctx.get('max_length', '?'):,} items",
    "too_short": lambda given, ctx, field: f"at least {ctx.get('min_length', '?')} item(s)",
    "string_too_long": lambda given, ctx, field:
        f"at most {ctx.get('max_length', '?'):,} characters",
    "string_too_short": lambda given, ctx, field:
        f"at least {ctx.get('min_length', '?')} character(s)",
}


def _a(noun: str) -> _Describe:
    return lambda given, ctx, field: f"{noun}, not {_shown(given)}"


for _kinds, _noun in ((("int_type", "int_parsing", "int_from_float"), "a whole number"),
                      (("float_type", "float_parsing", "finite_number"), "a finite number"),
                      (("string_type", "string_unicode"), "text")):
    _WHAT.update(dict.fromkeys(_kinds, _a(_noun)))


def _what(kind: str, given: Any, ctx: Mapping[str, Any], field: str) -> str | None:
    """What the field must be, or None for a kind without words of ours."""
    if kind in _BOUNDS:
        phrase, key = _BOUNDS[kind]
        limit = ctx.get(key)
        limit_text = f"{limit:,}" if isinstance(limit, int) else str(limit)
        return f"{phrase} {limit_text}, not {_shown(given)}"
    if kind.startswith(("datetime", "date_")):
        return f"not an ISO-8601 time: {_shown(given)}"
    describe = _WHAT.get(kind)
    return None if describe is None else describe(given, ctx, field)


def validation_message(errors: list[Any]) -> str:
    """The first problem pydantic found, in the words of the field: ``where: what``."""
    if not errors:
        return "invalid request"
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return "the request body is not JSON"
    if kind in ("model_attributes_type", "dict_type", "model_type") and len(loc) <= 1:
        return "the request body must be a JSON object"
    where = _where(loc)
    field = str(loc[-1]) if loc and not isinstance(loc[-1], int) else str(loc[-2] if len(loc) > 1
                                                                             else "")
    what = _what(kind, first.get("input"), first.get("ctx") or {}, field)
    if what is None:
        what = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return f"{where}: {what}" if where and kind != "value_error" else what
    return f"{where}: {what}" if where else what


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_r: Request, exc: ApiError) -> JSONResponse:
        return refusal(exc.status, exc.message, exc.headers)

    @app.exception_handler(TooMany)
    async def _many(_r: Request, exc: TooMany) -> JSONResponse:
        return refusal(429, str(exc), {"Retry-After": str(max(1, round(exc.retry_after)))})

    @app.exception_handler(DeskError)
    async def _desk(_r: Request, exc: DeskError) -> JSONResponse:
        return refusal(exc.status, str(exc))

    @app.exception_handler(InputError)
    async def _input(_r: Request, exc: InputError) -> JSONResponse:
        return refusal(400, str(exc))

    @app.exception_handler(BrokerError)
    async def _broker(_r: Request, exc: BrokerError) -> JSONResponse:
        return refusal(503, f"the broker: {exc}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        return refusal(400, validation_message(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(_r: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body is not JSON (or nested too deeply)"
        return refusal(exc.status_code, message)
