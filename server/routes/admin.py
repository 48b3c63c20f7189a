"""Liveness, readiness (with start-up progress and each engine's load), Prometheus metrics and
the fidelity spot checks."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..deps import auth, metrics_auth, ready_state, server_state
from ..errors import APIError

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = server_state(request)
    failed = [v.served_id for v in state.variants if not v.engine.alive]
    if failed:
        return JSONResponse({"status": "engine failed", "models": failed}, status_code=503)
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    state = server_state(request)
    body = {"status": state.status, "detail": state.detail, "uptime_s": round(time.time() - state.started, 1)}
    if state.startup is not None:  # stage, step k of n, ETA of the stage
        body["progress"] = state.startup.snapshot().as_dict()
        if state.startup.memory:  # what the first start will hold, said before it starts
            body["progress"]["memory"] = state.startup.memory
    if state.variants:  # each variant's engine, and their sum
        engines = {v.served_id: {"running": v.engine.stats.running, "waiting": v.engine.stats.waiting,
                                 "in_flight": v.inflight,
                                 "prefix_cache_bytes": v.engine.stats.prefix_cache_bytes}
                   for v in state.variants}
        body["engine"] = {k: sum(e[k] for e in engines.values()) for k in next(iter(engines.values()))}
        body["engines"] = engines
    if state.ready:
        return body
    return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})


@router.get("/metrics", dependencies=[Depends(metrics_auth)])
async def metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/fidelity", dependencies=[Depends(auth)])
async def fidelity(request: Request, limit: int = 50, variant: str | None = None):
    st = ready_state(server_state(request))
    labels = [v.variant for v in st.variants]
    if variant is not None and variant not in labels:
        raise APIError(404, f"no served variant '{variant}'; served: {', '.join(labels)}",
                       param="variant", code="variant_not_found")
    if st.fidelity is None:
        return {"enabled": False, "variants": labels, "checks": []}
    return {"enabled": True, "variants": labels, **st.fidelity.view(max(1, min(limit, 1000)), variant)}
