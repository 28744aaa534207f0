"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure, and the one JSON
encoder every response uses.

FastAPI's 422 for invalid bodies becomes a 400 (as vLLM and SGLang do) and unknown routes keep their 404/405. An
unexpected exception is answered by `middleware.ContainErrors` (a 500 with the same body that keeps the
connection open), not here: Starlette re-raises exceptions its own catch-all handler answers, which resets the
client's keep-alive connection.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("evalpipe.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    503: "server_overloaded",
}


# Characters that JSON allows raw inside strings but that line-splitting readers (str.splitlines, httpx's
# aiter_lines) take for line breaks; escaped so that every JSON document, and so every SSE event, is one line.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


# Built once (json.dumps builds an encoder per call, and a stream encodes a chunk per token). No cycle check: every
# body is acyclic plain data built per response, so the check would only cost a dict insert and delete per container.
_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, check_circular=False, separators=(",", ":")).encode


def json_bytes(obj) -> bytes:
    """Compact UTF-8 JSON that any reader can take as one line, and that never fails on a lone surrogate.

    A lone surrogate (from a request string, e.g. `"\\ud800"`) cannot be UTF-8 encoded; backslashreplace writes it
    as the JSON escape it came in as (it only ever occurs inside a JSON string, where `\\udXXX` is valid)."""
    text = _ENCODE(obj)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:  # rare; translate costs a dict lookup per character
        text = text.translate(_LINE_BREAKS)
    return text.encode("utf-8", "backslashreplace")


class SafeJSONResponse(JSONResponse):
    """JSONResponse rendered by `json_bytes` (FastAPI's default response class in this server)."""

    def render(self, content) -> bytes:
        return json_bytes(content)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            code="invalid_json",
        )
    if loc == [] and isinstance(first.get("input"), (bytes, str)) and first.get("type") in ("model_type", "dict_type"):
        return bad_request(
            "the request body must be a JSON object sent with 'Content-Type: application/json'", code="invalid_json"
        )
    if first.get("type") == "lone_surrogate":
        return bad_request(first["msg"], param=first["ctx"]["param"], code="invalid_unicode")
    param = loc[0] if loc else None  # the top-level field, as OpenAI reports it
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    where = f"{'.'.join(loc)}: " if loc else ""
    return bad_request(f"{where}{msg}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError):
        return bad_request(f"request body is not valid JSON: {exc}", code="invalid_json").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
