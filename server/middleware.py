"""Plain ASGI middleware (not BaseHTTPMiddleware, so endpoints still see a client's disconnect):
the body limit and its Unicode check, request counting, and a last guard that turns any
unexpected exception into one OpenAI-shaped 500 without dropping the keep-alive connection."""

from __future__ import annotations

import json
import logging
import re

from .errors import APIError
from .metrics import Metrics

log = logging.getLogger("mixbit.server")

# A UTF-16 surrogate (U+D800-U+DFFF) as a JSON escape, or encoded as (invalid) UTF-8 bytes, which
# Python's JSON parser also lets through; only bodies that contain one are parsed here, to find
# the strings where one stands alone (a valid escaped pair decodes to one character).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _is_surrogate(ch: str) -> bool:
    return "\ud800" <= ch <= "\udfff"


def printable(text: str) -> str:
    """Text that can be encoded as UTF-8: lone surrogates written as \\udXXX escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate(value, path: str = "") -> tuple[str, int] | None:
    """(JSON path, character index) of the first string (or key, index -1) with a lone
    surrogate; the path itself is printable."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            for i, ch in enumerate(item):
                if _is_surrogate(ch):
                    return where, i
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                inner = f"{where}.{printable(key)}" if where else printable(key)
                if any(_is_surrogate(ch) for ch in key):
                    return inner, -1
                stack.append((sub, inner))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in reversed(list(enumerate(item))))
    return None


def unicode_error(found: tuple[str, int] | None) -> APIError | None:
    if found is None:
        return None
    path, index = found
    where = f" at character {index}" if index >= 0 else " in a key"
    return APIError(400, f"{path or 'body'}: invalid Unicode{where} (a lone UTF-16 surrogate); "
                    "strings must be valid Unicode text", param=path or None, code="invalid_unicode")


def reject_invalid_unicode(value, param: str) -> None:
    """For values decoded from JSON strings inside a request (tool-call arguments)."""
    err = unicode_error(lone_surrogate(value, param))
    if err is not None:
        raise err


class CheckBody:
    """413 for bodies over the limit (counted as they arrive, chunked too); 400 naming the field
    for strings that are not valid Unicode (lone surrogates such as "\\ud800", which no tokenizer
    can encode), and for JSON nested too deeply to parse. The body is read here once and handed
    on unchanged."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body exceeds server.max_body_bytes ({self.limit} bytes)",
                           code="request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big.response(scope.get("path"))(scope, receive, send)
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                return await too_big.response(scope.get("path"))(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        err = self._check_json(body)
        if err is not None:
            return await err.response(scope.get("path"))(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: disconnects

        await self.app(scope, replay, send)

    @staticmethod
    def _check_json(body: bytes) -> APIError | None:
        """Parses only bodies that may need it: those with a surrogate escape, and those with
        enough brackets to be nested deeper than a JSON parser recurses."""
        surrogate = _SURROGATE.search(body) is not None
        if not surrogate and body.count(b"[") + body.count(b"{") < 256:
            return None
        try:
            data = json.loads(body)
        except RecursionError:
            return APIError(400, "the request body is nested too deeply to parse",
                            code="invalid_json")
        except ValueError:
            return None  # not JSON: the route's own parser says so
        return unicode_error(lone_surrogate(data)) if surrogate else None


class CountRequests:
    """Counts requests by route and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            endpoint = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


class CatchAll:
    """An exception no handler took becomes a 500 in OpenAI's shape. Unlike Starlette's own
    server-error handler it does not re-raise, so the server keeps the connection open."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
                await err.response(scope.get("path"))(scope, receive, send)
