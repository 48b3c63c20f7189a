"""One exception type, two response shapes: OpenAI's `{"error": {"message", "type", "param",
"code"}}`, and Anthropic's `{"type": "error", "error": {"type", "message"}}` on its routes
(/v1/messages...), chosen by the request's path."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("mixbit.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "server_error", 504: "server_error"}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "api_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_route(path: str | None) -> bool:
    return bool(path) and (path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"))


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        def text(v):  # a message may quote the input: never let it fail to encode
            return v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v

        return {"error": {"message": text(self.message), "type": self.type,
                          "param": text(self.param), "code": self.code}}

    def anthropic_body(self) -> dict:
        message = self.body()["error"]["message"]
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The error in the shape of the API `path` belongs to."""
        body = self.anthropic_body() if anthropic_route(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def param_of(loc: tuple) -> str:
    """A pydantic error location as OpenAI names a parameter: messages[0].content."""
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        messages = {404: "no such route", 405: "method not allowed on this route"}
        return APIError(exc.status_code, str(exc.detail) if exc.detail and exc.status_code not in messages
                        else messages.get(exc.status_code, str(exc.detail)),
                        code={404: "not_found"}.get(exc.status_code)).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}",
                        code="internal_error").response(request.url.path)


def validation_error(exc: RequestValidationError) -> APIError:
    """A request body that failed validation, as one 400 naming the first field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: "
                        f"{first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    # a union's branches each report an error below the field: name the field itself
    loc = tuple(first.get("loc", ()))
    for other in errors[1:]:
        o = tuple(other.get("loc", ()))
        if o[:2] != loc[:2]:
            continue
        n = 0
        while n < min(len(loc), len(o)) and loc[n] == o[n]:
            n += 1
        if n < min(len(loc), len(o)) and isinstance(loc[n], str) and isinstance(o[n], str):
            loc = loc[:n]  # branches (str / list[str] / ...), not two list items
    param = param_of(loc)
    msg = first["msg"].removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "this field is required"
    extra = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {msg}{extra}", param=param or None,
                    code="invalid_value")


def error_event(err: APIError) -> str:
    """An error as the data of a server-sent event (for failures after a stream started)."""
    return json.dumps(err.body())
