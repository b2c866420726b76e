"""OpenAI-style errors: one exception type, one body shape, and the handlers that render them.

What a client reads is `message`: never a worker id, a host, an upstream service's error text or an
exception's repr (docs/security.md, "Round 2"). What went wrong inside goes in `detail`, which only the
router's log and the request's trace see, next to the request id the client has (x-request-id)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    499: "cancelled",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        # the cause, for the log and the trace only (a worker id, an upstream's answer, an exception):
        # never part of the body
        self.detail = detail

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unavailable(message: str, retry_after_s: int, detail: str | None = None) -> APIError:
    """503 with Retry-After: nothing to route to, or every service too busy; the client may retry."""
    return APIError(503, message, headers={"Retry-After": str(retry_after_s)}, detail=detail)


def from_validation(errors: list[Any]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400; `param` is its dotted field path."""
    if not errors:
        return invalid("invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {err.get('msg', '')}", None, "invalid_json")
    loc: list[str] = []
    for part in err.get("loc", ()):
        # pydantic names union members in the path ("content.str", "prompt.list[int]"): stop there
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break
        if part != "body" or loc:
            loc.append(str(part))
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return invalid(f"{param}: {msg}" if param else msg, param)


def install_handlers(app: FastAPI) -> None:
    """FastAPI's default 422 and plain-text HTTP errors become OpenAI-style bodies."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation(list(exc.errors())).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return err.response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
