"""What the routes share: the server's state, API-key auth, readiness, and the served variant a
request names (FastAPI dependencies and plain helpers)."""

from __future__ import annotations

import hmac
import threading

from fastapi import Request

from .errors import APIError
from .planning import reject_unsupported
from .state import ServerState

_THREAD = threading.local()  # each worker thread's own MLX stream (MLX streams are per thread)


def server_state(request: Request) -> ServerState:
    return request.app.state.mixbit


async def auth(request: Request) -> bool:
    """True when the request carried a valid key; False when the server has no keys."""
    keys = [k.encode() for k in server_state(request).settings.server.api_keys]
    if not keys:
        return False
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not supplied:  # Anthropic's clients send the key as x-api-key
        supplied = request.headers.get("x-api-key", "").strip().encode()
    # compare against every key, in constant time, so timing says nothing about them
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(supplied, k)
    if not ok:
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return True


async def metrics_auth(request: Request) -> None:
    """/metrics asks for a key only with server.metrics_auth."""
    if server_state(request).settings.server.metrics_auth:
        await auth(request)


def ready_state(state: ServerState) -> ServerState:
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down",
                       headers={"Retry-After": "5"})
    if not state.ready:
        if state.status == "failed":
            raise APIError(503, f"the model failed to load: {state.detail}", code="model_failed")
        raise APIError(503, f"the model is not ready yet ({state.detail or state.status})",
                       code="model_not_ready", headers={"Retry-After": "2"})
    return state


def pick(state: ServerState, name: str | None) -> ServerState:
    """The served variant a request names (`<name>:<variant>`, or the bare name: the first);
    none named: the first."""
    st = ready_state(state)
    if name is None:
        return st.variants[0]
    found = st.aliases.get(name)
    if found is None:
        served = ", ".join(f"'{v.served_id}'" for v in st.variants)
        raise APIError(404, f"the model '{name}' does not exist; this server serves {served} "
                       "(see GET /v1/models)", param="model", code="model_not_found")
    return found


def admit(state: ServerState, req) -> ServerState:
    """The checks every generation request passes before any work is done; the variant."""
    st = pick(state, req.model)
    reject_unsupported(req)
    return st


def mlx_call(fn, *args):
    """Runs MLX work from a worker thread on that thread's own stream."""
    import mlx.core as mx

    stream = getattr(_THREAD, "stream", None)
    if stream is None:
        stream = _THREAD.stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        return fn(*args)
