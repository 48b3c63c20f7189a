"""OpenAI's API: the model list, chat completions, text completions, and teacher-forced scoring
(what a remote fidelity reference answers)."""

from __future__ import annotations

import asyncio
import re

from fastapi import APIRouter, Depends, Request

from ..deps import admit, auth, mlx_call, pick, ready_state, server_state
from ..errors import APIError
from ..fidelity import score_top
from ..planning import chat_plan, completion_plans
from ..protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, ScoreRequest
from ..serving import run_plan
from ..state import ServerState

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request, authenticated: bool = Depends(auth)) -> ModelList:
    return ModelList(data=[card(v, authenticated) for v in ready_state(server_state(request)).variants])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request, authenticated: bool = Depends(auth)) -> ModelCard:
    return card(pick(server_state(request), model_id), authenticated)


@router.post("/v1/chat/completions", dependencies=[Depends(auth)])
async def chat_completions(req: ChatCompletionRequest, request: Request):
    st = admit(server_state(request), req)
    plan = chat_plan(st, req)
    return await run_plan(st, request, plan, req.n, req.stream,
                          req.stream_options.include_usage if req.stream_options else False)


@router.post("/v1/completions", dependencies=[Depends(auth)])
async def completions(req: CompletionRequest, request: Request):
    st = admit(server_state(request), req)
    plans = completion_plans(st, req)
    if req.stream and len(plans) > 1:
        raise APIError(400, "streaming accepts one prompt per request", param="prompt")
    if len(plans) == 1:
        return await run_plan(st, request, plans[0], req.n, req.stream,
                              req.stream_options.include_usage if req.stream_options else False)
    results = [await run_plan(st, request, p, req.n, False, False, index_base=i * req.n)
               for i, p in enumerate(plans)]
    merged = results[0]
    for r in results[1:]:
        merged.choices += r.choices
        merged.usage.prompt_tokens += r.usage.prompt_tokens
        merged.usage.completion_tokens += r.usage.completion_tokens
        merged.usage.total_tokens += r.usage.total_tokens
    return merged


@router.post("/v1/score", dependencies=[Depends(auth)])
async def score(body: ScoreRequest, request: Request):
    """Teacher-forced top-k log-probabilities (what a remote fidelity reference answers)."""
    st = pick(server_state(request), body.model or None)
    if st.group is not None and st.group.size() > 1:
        raise APIError(400, "scoring is not available on a distributed (sharded) server",
                       code="unsupported_in_distributed")
    vocab = len(st.lm.hf_tokenizer)
    if not 1 <= body.start < len(body.tokens) or any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab}) and 1 <= start < len(tokens)",
                       param="tokens", code="invalid_value")
    if len(body.tokens) > st.context_length:
        raise APIError(400, f"at most {st.context_length} tokens", param="tokens",
                       code="context_length_exceeded")
    top = await asyncio.to_thread(mlx_call, score_top, st.lm.model, body.tokens, body.start, body.top_k)
    return {"object": "score", "model": st.served_id, "start": body.start, "top_logprobs": top}


def _is_local_path(value: str) -> bool:
    return value.startswith(("/", "~", "./", "../", "file:")) or re.match(r"^[A-Za-z]:[\\/]", value) is not None


def without_local_paths(value):
    """Provenance as an unauthenticated client may see it: local paths (the cache, a local
    source folder, a calibration file) replaced by a placeholder."""
    if isinstance(value, dict):
        return {k: without_local_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_local_paths(v) for v in value]
    if isinstance(value, str) and _is_local_path(value):
        return "<local path>"
    return value


def card(st: ServerState, authenticated: bool) -> ModelCard:
    """Local paths only for a request that presented a valid API key."""
    provenance = st.provenance if authenticated else without_local_paths(st.provenance)
    return ModelCard(id=st.served_id, created=st.created, max_model_len=st.context_length, mixbit=provenance)
