"""The FastAPI app: start-up, readiness, auth and limits, and the OpenAI routes."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from mixbit.models.grammar import CompiledGrammar, GrammarEngine, GrammarError, chat_grammar
from mixbit.models.loading import LoadedModel, load, prompt_opens_think, render_chat
from mixbit.models.registry import ModelSourceError, resolve
from mixbit.models.toolcall import StreamingOutputParser, parser_for_template
from mixbit.quant.variants import ensure_variant

from . import errors
from .engine import Engine, FinishEvent, TokenEvent, async_emitter
from .errors import APIError
from .fidelity import FidelityWorker, Job, LocalReference, RemoteReference, score_top
from .metrics import Metrics
from .protocol import (UNSUPPORTED, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                       ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChoiceLogprobs, Completion,
                       CompletionChoice, CompletionLogprobs, CompletionRequest, FunctionCallOut, ModelCard,
                       ModelList, PromptTokensDetails, ScoreRequest, TokenLogprob, ToolCallDelta, ToolCallOut, TopLogprob,
                       Usage, new_id)
from .responses import ResponseBuilder, ResponsesRequest, ResponseStore, chat_body, usage_of
from .sampling import SamplingParams
from .settings import Settings

log = logging.getLogger("mixbit.server")
_THREAD = threading.local()


def _mlx_call(fn, *args):
    """Runs MLX work from a worker thread on that thread's own stream."""
    import mlx.core as mx

    stream = getattr(_THREAD, "stream", None)
    if stream is None:
        stream = _THREAD.stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        return fn(*args)


@dataclass
class ServerState:
    settings: Settings
    status: str = "starting"  # starting -> resolving -> quantizing -> loading -> ready | failed
    detail: str = ""
    started: float = field(default_factory=time.time)
    lm: LoadedModel | None = None
    engine: Engine | None = None
    grammar: GrammarEngine | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)
    metrics: Metrics | None = None
    fidelity: FidelityWorker | None = None
    group: Any = None  # mx.distributed group when serving one model over several ranks
    served_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    provenance: dict = field(default_factory=dict)
    context_length: int = 4096
    inflight: int = 0
    draining: bool = False

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self.engine is not None and self.engine.alive


def served_name(settings: Settings, resolved) -> str:
    return settings.model.served_name or resolved.name


def ensure_shared_variant(s: Settings, resolved, progress, group=None):
    """ensure_variant; in a distributed group rank 0 quantizes first and the others then find
    the verified entry (same host) or build the identical one (their own host)."""
    def ensure():
        return ensure_variant(resolved, s.quant.recipe, s.model.cache_dir, progress,
                              target_bpw=s.quant.target_bpw if s.quant.recipe == "mixbit-auto" else None,
                              calibration=s.quant.calibration or None,
                              sensitivity=s.quant.sensitivity)

    if group is None or group.size() == 1:
        return ensure()
    import mlx.core as mx

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))

    if group.rank() == 0:
        variant = ensure()
        barrier()
        return variant
    barrier()
    return ensure()


def follow(settings: Settings, group) -> int:
    """A rank > 0 of `mixbit serve --distributed`: loads its shard and mirrors rank 0's engine."""
    s = settings
    resolved = resolve(s.model.source, s.model.revision, s.model.hub_cache_dir or None,
                       s.model.allow_download)
    variant = ensure_shared_variant(s, resolved, log.info, group)
    lm = load(resolved, s.generation.compute_dtype, path=variant.path, group=group)
    text_cfg = lm.config.get("text_config", lm.config)
    grammar = GrammarEngine(lm.tokenizer._tokenizer, int(text_cfg["vocab_size"]),
                            sorted(lm.tokenizer.eos_token_ids))
    engine = Engine(lm.model, lm.tokenizer, max_batch=s.server.max_concurrent_sequences,
                    cache_entries=s.server.prefix_cache_entries,
                    cache_bytes=s.server.prefix_cache_bytes, model_key=served_name(s, resolved),
                    group=group, grammar_engine=grammar)
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    engine.run_follower()
    log.info("rank %d: rank 0 stopped; exiting", group.rank())
    return 0


def start_loading(state: ServerState) -> threading.Thread:
    """Resolves and loads the model off the event loop; /ready reports progress meanwhile."""
    def work():
        s = state.settings
        try:
            state.status, state.detail = "resolving", f"resolving {s.model.source}"
            resolved = resolve(s.model.source, s.model.revision, s.model.hub_cache_dir or None,
                               s.model.allow_download)
            state.status = "quantizing"

            def progress(msg: str) -> None:
                state.detail = msg
                log.info(msg)

            variant = ensure_shared_variant(s, resolved, progress, state.group)
            state.status, state.detail = "loading", f"loading {variant.path}"
            lm = load(resolved, s.generation.compute_dtype, path=variant.path, group=state.group)
            text_cfg = lm.config.get("text_config", lm.config)
            state.context_length = int(text_cfg.get("max_position_embeddings", 4096))
            state.served_id = served_name(s, resolved)
            state.provenance = {**variant.manifest, "model_type": resolved.model_type,
                                "path": str(variant.path)}
            grammar = GrammarEngine(lm.tokenizer._tokenizer, int(text_cfg["vocab_size"]),
                                    sorted(lm.tokenizer.eos_token_ids))
            engine = Engine(lm.model, lm.tokenizer, max_batch=s.server.max_concurrent_sequences,
                            cache_entries=s.server.prefix_cache_entries,
                            cache_bytes=s.server.prefix_cache_bytes, model_key=state.served_id,
                            on_token_gap=state.metrics.itl.observe if state.metrics else None,
                            group=state.group, grammar_engine=grammar)
            state.grammar = grammar
            engine.start()
            if state.metrics is not None:
                state.metrics.set_variant(state.provenance)
            state.fidelity = _fidelity_worker(state, resolved, variant, lm)
            state.lm, state.engine = lm, engine
            state.status, state.detail = "ready", ""
            log.info("ready: serving %s as %r", resolved.path, state.served_id)
        except ModelSourceError as exc:
            state.status, state.detail = "failed", str(exc)
            log.error("cannot serve: %s", exc)
        except Exception as exc:  # noqa: BLE001 - reported on /ready and in the log
            state.status, state.detail = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("start-up failed")

    t = threading.Thread(target=work, name="mixbit-loader", daemon=True)
    t.start()
    return t


def _weights_bytes(folder) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _fidelity_worker(state: ServerState, resolved, variant, lm) -> FidelityWorker | None:
    """The spot-check worker for what is served, or None when checks are off."""
    f = state.settings.fidelity
    if not f.enabled or state.metrics is None:
        return None
    if state.group is not None and state.group.size() > 1:
        # a check runs the served model outside the lockstep engine; with tensor-parallel
        # shards that would need the other ranks too
        log.warning("fidelity spot checks are off in distributed serving: the served model is "
                    "sharded across ranks; run checks on a single-process replica")
        return None
    ref = f.reference.strip()
    disabled = None
    if ref.startswith(("http://", "https://")):
        reference = RemoteReference(ref, f.reference_api_key, f.top_k)
    else:
        if ref == "auto":
            if resolved.quantized:
                source, folder = None, None
                disabled = ("the served checkpoint is already quantized and its unquantized source "
                            "is unknown; set fidelity.reference")
            else:
                source, folder = resolved, resolved.path
        else:
            source = resolve(ref, allow_download=False)
            folder = source.path
        same = folder is not None and str(folder) == str(variant.path)
        if same:  # serving bf16: the reference is the served model itself
            reference = LocalReference(lambda: lm.model, "the served model (unquantized)")
        else:
            dtype = state.settings.generation.compute_dtype
            reference = LocalReference(lambda: load(source, dtype).model,
                                       f"{getattr(source, 'source', ref)} (unquantized, in process)")
            need = 2 * _weights_bytes(folder) if folder else 0  # bf16 files, float32 on CPU
            if f.reference_max_bytes and need > f.reference_max_bytes:
                disabled = (f"the reference needs about {need} bytes, over "
                            f"fidelity.reference_max_bytes ({f.reference_max_bytes}); point "
                            "fidelity.reference at a bf16 instance instead")
    name = state.provenance.get("recipe", "served")
    worker = FidelityWorker(lm.model, reference, state.metrics, str(name),
                            sample_rate=f.sample_rate, max_per_minute=f.max_per_minute,
                            queue_size=f.queue_size, max_tokens=f.max_tokens, keep=f.keep)
    worker.disabled = disabled
    if disabled:
        log.warning("fidelity spot checks disabled: %s", disabled)
    worker.start()
    log.info("fidelity spot checks: %.0f%% of requests (at most %d a minute) against %s",
             100 * f.sample_rate, f.max_per_minute, reference.describe)
    return worker


class BodyLimit:
    """ASGI middleware: 413 for bodies over the limit, counted as they arrive (chunked too)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = APIError(413, f"request body exceeds server.max_body_bytes ({self.limit} bytes)",
                           code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await too_big.response()(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(settings: Settings, *, load_model: bool = True, group=None) -> FastAPI:
    state = ServerState(settings=settings, group=group)
    state.metrics = Metrics(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_model:
            start_loading(state)
        yield
        state.draining = True
        deadline = time.monotonic() + settings.server.shutdown_grace_s
        while state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.engine is not None:
            state.engine.close()
        if state.fidelity is not None:
            state.fidelity.close()

    app = FastAPI(title="mixbit", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible server for mixed-bit quantized Qwen3.5")
    app.state.mixbit = state
    errors.install(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=settings.server.max_body_bytes)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response
    keys = [k.encode() for k in settings.server.api_keys]

    async def auth(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare against every key, in constant time, so timing says nothing about them
        ok = False
        for k in keys:
            ok |= hmac.compare_digest(supplied, k)
        if not ok:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def ready_state() -> ServerState:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": "5"})
        if not state.ready:
            if state.status == "failed":
                raise APIError(503, f"the model failed to load: {state.detail}", code="model_failed")
            raise APIError(503, f"the model is not ready yet ({state.detail or state.status})",
                           code="model_not_ready", headers={"Retry-After": "2"})
        return state

    def check_model(name: str) -> None:
        if name != state.served_id:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{state.served_id}' (see GET /v1/models)", param="model",
                           code="model_not_found")

    @app.get("/health")
    async def health():
        if state.engine is not None and not state.engine.alive:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        body = {"status": state.status, "detail": state.detail,
                "uptime_s": round(time.time() - state.started, 1)}
        if state.engine is not None:
            e = state.engine.stats
            body["engine"] = {"running": e.running, "waiting": e.waiting, "in_flight": state.inflight,
                              "prefix_cache_bytes": e.prefix_cache_bytes}
        if state.ready:
            return body
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> ModelList:
        st = ready_state()
        return ModelList(data=[_card(st)])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(auth)])
    async def model(model_id: str) -> ModelCard:
        st = ready_state()
        check_model(model_id)
        return _card(st)

    def admit(req) -> ServerState:
        """The checks every generation request passes before any work is done."""
        st = ready_state()
        check_model(req.model)
        _reject_unsupported(req)
        return st

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        st = admit(req)
        plan = _chat_plan(st, req)
        return await _run(st, request, plan, req.n, req.stream,
                          req.stream_options.include_usage if req.stream_options else False)

    metrics_deps = [Depends(auth)] if settings.server.metrics_auth else []

    @app.get("/metrics", dependencies=metrics_deps)
    async def metrics():
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/fidelity", dependencies=[Depends(auth)])
    async def fidelity(limit: int = 50):
        st = ready_state()
        if st.fidelity is None:
            return {"enabled": False, "checks": []}
        return {"enabled": True, **st.fidelity.view(max(1, min(limit, 1000)))}

    @app.post("/v1/score", dependencies=[Depends(auth)])
    async def score(body: ScoreRequest):
        """Teacher-forced top-k log-probabilities (what a remote fidelity reference answers)."""
        st = ready_state()
        check_model(body.model) if body.model else None
        if st.group is not None and st.group.size() > 1:
            raise APIError(400, "scoring is not available on a distributed (sharded) server",
                           code="unsupported_in_distributed")
        vocab = len(st.lm.tokenizer._tokenizer)
        if not 1 <= body.start < len(body.tokens) or any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab}) and 1 <= start < len(tokens)",
                           param="tokens", code="invalid_value")
        if len(body.tokens) > st.context_length:
            raise APIError(400, f"at most {st.context_length} tokens", param="tokens",
                           code="context_length_exceeded")
        top = await asyncio.to_thread(_mlx_call, score_top, st.lm.model, body.tokens, body.start,
                                      body.top_k)
        return {"object": "score", "model": st.served_id, "start": body.start, "top_logprobs": top}

    @app.post("/v1/responses", dependencies=[Depends(auth)])
    async def responses(req: ResponsesRequest, request: Request):
        st = ready_state()
        check_model(req.model)
        history: list[dict] = []
        if req.previous_response_id:
            found = st.responses.get(req.previous_response_id)
            if found is None:
                raise APIError(404, f"no stored response {req.previous_response_id!r} (this server "
                               f"keeps the last {st.responses.capacity}, in memory)",
                               param="previous_response_id", code="response_not_found")
            history = found
        body = chat_body(req, history)
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise APIError(400, f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}",
                           code="invalid_value") from None
        plan = _chat_plan(st, chat)
        plan.endpoint = "/v1/responses"
        (choice,) = _start(st, plan, 1)
        builder = ResponseBuilder(req, st.served_id)
        # what a continuation sees: the messages without this request's instructions
        conversation = body["messages"][1:] if req.instructions else body["messages"]
        if req.stream:
            return EventSourceResponse(_stream_response(st, request, plan, choice, builder,
                                                        conversation), ping=15, send_timeout=30)
        try:
            await _collect(request, st, [choice])
        finally:
            _release(st, [choice])
        events = choice.feed(choice.text, final=True)
        builder.feed(events, plan.parallel)
        builder.finish(choice.finish.reason if choice.finish else "stop", usage_of(choice.finish))
        _account(st, plan, [choice], builder.id)
        if req.store:
            st.responses.put(builder.id, conversation + builder.messages())
        return builder.response("incomplete" if choice.finish and choice.finish.reason == "length"
                                else "completed", usage_of(choice.finish),
                                "max_output_tokens" if choice.finish and choice.finish.reason == "length"
                                else None)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: CompletionRequest, request: Request):
        st = admit(req)
        plans = _completion_plans(st, req)
        if req.stream and len(plans) > 1:
            raise APIError(400, "streaming accepts one prompt per request", param="prompt")
        if len(plans) == 1:
            return await _run(st, request, plans[0], req.n, req.stream,
                              req.stream_options.include_usage if req.stream_options else False)
        results = [await _run(st, request, p, req.n, False, False, index_base=i * req.n)
                   for i, p in enumerate(plans)]
        merged = results[0]
        for r in results[1:]:
            merged.choices += r.choices
            merged.usage.prompt_tokens += r.usage.prompt_tokens
            merged.usage.completion_tokens += r.usage.completion_tokens
            merged.usage.total_tokens += r.usage.total_tokens
        return merged

    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mixbit")
    except PackageNotFoundError:
        return "0"


def _card(st: ServerState) -> ModelCard:
    return ModelCard(id=st.served_id, created=st.created, mixbit=st.provenance)


def _reject_unsupported(req) -> None:
    extra = req.model_extra or {}
    for name, why in UNSUPPORTED.items():
        if name not in extra or extra[name] in (None, False, [], {}):
            continue
        if name == "modalities" and extra[name] == ["text"]:
            continue
        raise APIError(400, f"{name}: {why or 'only text output is supported'}", param=name,
                       code="unsupported_parameter")


# ----------------------------------------------------------------------------------- planning
@dataclass
class Plan:
    kind: str  # chat or completion
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""
    tools: list[dict] | None = None
    parse_tools: bool = False
    opened_think: bool = False
    echo: str = ""
    parallel: bool = True  # parallel_tool_calls: false returns the first call only
    grammar: CompiledGrammar | None = None
    forced_tools: bool = False  # tool_choice required / named
    json_schema: dict | None = None  # response_format's schema (json_object: {"type": "object"})
    endpoint: str = ""


def _sampling(st: ServerState, req, max_tokens: int | None, prompt_len: int,
              top_logprobs: int) -> SamplingParams:
    g = st.settings.generation
    room = st.context_length - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                       f"{st.context_length} tokens", param="messages", code="context_length_exceeded")
    limit = st.settings.server.max_prompt_tokens
    if limit and prompt_len > limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens; server.max_prompt_tokens is "
                       f"{limit}", param="messages", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) "
                       f"exceeds the context of {st.context_length} tokens; at most {room} "
                       "tokens can be generated", param="max_tokens", code="context_length_exceeded")
    vocab = len(st.lm.tokenizer._tokenizer)
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        tid = int(key)
        if not 0 <= tid < vocab:
            raise APIError(400, f"logit_bias: token id {tid} is outside the vocabulary",
                           param="logit_bias", code="invalid_value")
        bias[tid] = float(value)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else min(g.max_tokens, room),
        temperature=g.temperature if req.temperature is None else req.temperature,
        top_p=g.top_p if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop_list(),
        logprobs=bool(req.logprobs), top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=bias)


def _template_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": m.text()}
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is "
                                       "not valid JSON", param=f"messages[{i}].tool_calls[{j}]",
                                       code="invalid_value") from None
                if not isinstance(args, dict):
                    raise APIError(400, "tool call arguments must be a JSON object",
                                   param=f"messages[{i}].tool_calls[{j}]", code="invalid_value")
                calls.append({"type": "function", "id": c.id,
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _chat_plan(st: ServerState, req: ChatCompletionRequest) -> Plan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if tools is None and choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = bool(kwargs.pop("enable_thinking", st.settings.generation.enable_thinking))
    render_tools = tools if choice != "none" else None
    try:
        text = render_chat(st.lm.tokenizer, _template_messages(req), render_tools,
                           enable_thinking=thinking, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # jinja raise_exception and friends
        raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages",
                       code="invalid_messages") from None
    ids = st.lm.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = _sampling(st, req, max_tokens, len(ids), req.top_logprobs or 0)
    opened_think = prompt_opens_think(text)
    parallel = req.parallel_tool_calls is not False
    parser = parser_for_template(st.lm.chat_template)
    try:
        grammar = chat_grammar(render_tools, choice, parallel, req.response_format, opened_think,
                               "json" if parser.__class__.__name__ == "JsonToolParser" else "xml",
                               names_under_auto=st.settings.generation.tool_grammar)
        compiled = None
        if grammar:
            misses = st.grammar.misses
            compiled = st.grammar.compile(grammar)
            if st.metrics is not None:
                fresh = st.grammar.misses > misses
                st.metrics.grammar_requests.labels("miss" if fresh else "hit").inc()
                if fresh:
                    st.metrics.grammar_compile.observe(compiled.compile_ms / 1000)
    except GrammarError as exc:
        param = exc.param or ("response_format" if req.response_format else "tools")
        raise APIError(400, f"cannot enforce this {param}: {exc}", param=param,
                       code="unsupported_schema" if "cannot" in str(exc) or "Unknown" in str(exc)
                       else "invalid_value") from None
    rf = req.response_format or {}
    schema = None
    if rf.get("type") == "json_object":
        schema = {"type": "object"}
    elif rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema") or {"type": "object"}
    return Plan(kind="chat", prompt_ids=ids, params=params, prompt_text=text, tools=render_tools,
                parse_tools=render_tools is not None, opened_think=opened_think,
                parallel=parallel, grammar=compiled,
                forced_tools=choice == "required" or isinstance(choice, dict), json_schema=schema,
                endpoint="/v1/chat/completions")


def _completion_plans(st: ServerState, req: CompletionRequest) -> list[Plan]:
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    vocab = len(st.lm.tokenizer._tokenizer)
    plans = []
    for item in prompts:
        if isinstance(item, str):
            ids = st.lm.tokenizer.encode(item, add_special_tokens=False)
            text = item
        else:
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in item):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids, text = list(item), st.lm.tokenizer.decode(list(item))
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        top = int(req.logprobs) if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool) else 0
        params = _sampling(st, req, req.max_tokens if req.max_tokens is not None else 16, len(ids), top)
        params.logprobs = req.logprobs is not None and req.logprobs is not False
        plans.append(Plan(kind="completion", prompt_ids=ids, params=params, prompt_text=text,
                          echo=text if req.echo else "", endpoint="/v1/completions"))
    return plans


# ----------------------------------------------------------------------------------- running
_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


def _token_text_bytes(tokenizer, token_id: int) -> tuple[str, list[int]]:
    piece = tokenizer._tokenizer.convert_ids_to_tokens(token_id)
    dec = _byte_decoder()
    if piece is not None and all(ch in dec for ch in piece):
        raw = bytes(dec[ch] for ch in piece)
    else:  # added tokens (<|im_end|>, <tool_call>, ...) are stored as plain text
        raw = (piece or "").encode()
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_logprob(tokenizer, ev: TokenEvent) -> TokenLogprob:
    text, raw = _token_text_bytes(tokenizer, ev.token)
    tops = []
    for tid, lp in ev.top_logprobs or []:
        t, b = _token_text_bytes(tokenizer, tid)
        tops.append(TopLogprob(token=t, logprob=lp, bytes=b))
    return TokenLogprob(token=text, logprob=ev.logprob, bytes=raw, top_logprobs=tops)


@dataclass
class _Choice:
    index: int
    seq: Any = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""
    finish: FinishEvent | None = None
    logprobs: list = field(default_factory=list)
    parser: StreamingOutputParser | None = None
    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    content: str = ""  # parsed content so far (what metrics check for leaked markup)
    parse_errors: int = 0

    def feed(self, text: str, final: bool = False) -> list:
        """Parser events for new text (and the end); keeps what the accounting needs."""
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        for e in events:
            if e.kind == "content":
                self.content += e.text
            elif e.kind == "error":
                self.parse_errors += 1
        return events


def _finish_reason(choice: _Choice, calls: int) -> str:
    reason = choice.finish.reason if choice.finish else "stop"
    if reason in ("stop",) and calls:
        return "tool_calls"
    return {"timeout": "length"}.get(reason, reason)


def _start(st: ServerState, plan: Plan, n: int, index_base: int = 0) -> list[_Choice]:
    """Admits `n` sequences of one plan to the engine (or 429 when the queue is full)."""
    s = st.settings.server
    if st.inflight + n > s.max_concurrent_sequences + s.max_queue:
        raise APIError(429, f"the server is at capacity ({st.inflight} sequences in flight); retry "
                       "shortly", code="queue_full", headers={"Retry-After": "1"})
    loop = asyncio.get_running_loop()
    choices = [_Choice(index=index_base + i) for i in range(n)]
    template = st.lm.chat_template
    for c in choices:
        if plan.kind == "chat":
            c.parser = StreamingOutputParser(parser_for_template(template), plan.tools,
                                             plan.opened_think, parse_tools=plan.parse_tools)
        c.seq = st.engine.submit(plan.prompt_ids, plan.params, async_emitter(loop, c.queue),
                                 grammar=plan.grammar, draw_index=c.index,
                                 timeout_s=s.request_timeout_s)
    st.inflight += n
    return choices


async def _run(st: ServerState, request: Request, plan: Plan, n: int, stream: bool,
               include_usage: bool, index_base: int = 0):
    choices = _start(st, plan, n, index_base)
    rid = new_id("chatcmpl" if plan.kind == "chat" else "cmpl")
    if stream:
        gen = _stream_chat(st, request, plan, choices, rid, include_usage) if plan.kind == "chat" \
            else _stream_completion(st, request, plan, choices, rid, include_usage)
        return EventSourceResponse(gen, ping=15, send_timeout=30)
    try:
        await _collect(request, st, choices)
    finally:
        _release(st, choices)
    out = _chat_response(st, plan, choices, rid) if plan.kind == "chat" else \
        _completion_response(st, plan, choices, rid)
    _account(st, plan, choices, rid)
    return out


def _valid(value, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True  # not ours to judge; the grammar compiled it


def _account(st: ServerState, plan: Plan, choices: list[_Choice], rid: str) -> None:
    """Metrics of finished choices, and their offer to the fidelity worker."""
    m = st.metrics
    if m is None:
        return
    now = time.monotonic()
    for c in choices:
        f = c.finish
        if f is None:
            continue
        m.e2e.labels(plan.endpoint).observe(now - c.started)
        if c.first_at is not None:
            m.ttft.labels(plan.endpoint).observe(c.first_at - c.started)
        m.prompt_tokens.inc(max(f.prompt_tokens - f.cached_tokens, 0))
        m.cached_tokens.inc(f.cached_tokens)
        m.generation_tokens.inc(f.completion_tokens)
        kind = "completion"
        if plan.kind == "chat":
            kind = "chat"
            calls = c.parser.calls if c.parser else []
            if plan.tools:
                if calls:
                    kind = "tool_call"
                    m.tool_calls.labels("parsed").inc(len(calls))
                if c.parse_errors:
                    m.tool_calls.labels("parse_failed").inc(c.parse_errors)
                if "<tool_call>" in c.content or "<function=" in c.content:
                    m.tool_calls.labels("markup_in_content").inc()
                if plan.forced_tools and not calls and f.reason == "stop":
                    m.tool_calls.labels("forced_without_call").inc()
                if plan.grammar is not None:
                    for call in calls:
                        fn = next((t["function"] for t in plan.tools
                                   if t["function"]["name"] == call.name), {})
                        if (plan.forced_tools or fn.get("strict")) and fn.get("parameters") and \
                                not _valid(call.arguments, fn["parameters"]):
                            m.constrained_invalid.labels("tool_arguments").inc()
            if plan.json_schema is not None and not calls:
                kind = "json"
                if f.reason == "stop":
                    try:
                        ok = _valid(json.loads(c.content), plan.json_schema)
                    except ValueError:
                        ok = False
                    if not ok:
                        m.constrained_invalid.labels("json").inc()
        if st.fidelity is not None and f.reason in ("stop", "length"):
            st.fidelity.offer(Job(kind, plan.prompt_ids, f.tokens, rid))


def _release(st: ServerState, choices: list[_Choice]) -> None:
    for c in choices:
        if c.finish is None:
            st.engine.cancel(c.seq, "cancelled")
    st.inflight -= len(choices)


class _DisconnectWatch:
    """Asks the server whether the client left at most every `every` seconds, busy or idle."""

    def __init__(self, request: Request, every: float = 0.25):
        self.request, self.every, self.last, self.gone = request, every, time.monotonic(), False

    async def check(self) -> bool:
        now = time.monotonic()
        if not self.gone and now - self.last >= self.every:
            self.last = now
            self.gone = await self.request.is_disconnected()
        return self.gone


async def _next_event(watch: _DisconnectWatch, c: _Choice):
    """The next engine event for one choice; None when the client went away."""
    while True:
        if await watch.check():
            return None
        try:
            return await asyncio.wait_for(c.queue.get(), timeout=watch.every)
        except asyncio.TimeoutError:
            continue


async def _collect(request: Request, st: ServerState, choices: list[_Choice]) -> None:
    watch = _DisconnectWatch(request)

    async def one(c: _Choice):
        while c.finish is None:
            ev = await _next_event(watch, c)
            if ev is None:
                return
            if isinstance(ev, TokenEvent):
                if c.first_at is None:
                    c.first_at = time.monotonic()
                c.text += ev.text
                if ev.logprob is not None:
                    c.logprobs.append(ev)
            else:
                c.text += ev.text
                c.finish = ev
    await asyncio.gather(*(one(c) for c in choices))
    for c in choices:
        if c.finish is not None and c.finish.reason == "error":
            raise APIError(500, f"generation failed: {c.finish.error}", code="engine_error")


def _usage(choices: list[_Choice]) -> Usage:
    done = [c.finish for c in choices if c.finish]
    prompt = done[0].prompt_tokens if done else 0
    completion = sum(f.completion_tokens for f in done)
    cached = done[0].cached_tokens if done else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _tool_calls_out(calls, parallel: bool = True) -> list[ToolCallOut]:
    out = [ToolCallOut(id=new_id("call"), function=FunctionCallOut(
        name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False))) for c in calls]
    return out if parallel else out[:1]


def _chat_response(st: ServerState, plan: Plan, choices: list[_Choice], rid: str) -> ChatCompletion:
    out = []
    tok = st.lm.tokenizer
    for c in choices:
        events = c.feed(c.text, final=True)
        reasoning = "".join(e.text for e in events if e.kind == "reasoning").strip() or None
        content = "".join(e.text for e in events if e.kind == "content")
        calls = _tool_calls_out(c.parser.calls, plan.parallel)
        lp = ChoiceLogprobs(content=[_chat_logprob(tok, e) for e in c.logprobs]) if plan.params.logprobs else None
        out.append(ChatChoice(index=c.index, finish_reason=_finish_reason(c, len(calls)), logprobs=lp,
                              message=AssistantMessage(content=content if (content or not calls) else None,
                                                       reasoning_content=reasoning,
                                                       tool_calls=calls or None)))
    return ChatCompletion(id=rid, model=st.served_id, choices=out, usage=_usage(choices))


def _completion_logprobs(tok, events: list[TokenEvent], offset0: int) -> CompletionLogprobs:
    lp = CompletionLogprobs(top_logprobs=[])
    offset = offset0
    for e in events:
        text, _ = _token_text_bytes(tok, e.token)
        lp.tokens.append(text)
        lp.token_logprobs.append(e.logprob)
        lp.text_offset.append(offset)
        offset += len(text)
        lp.top_logprobs.append({_token_text_bytes(tok, t)[0]: v for t, v in (e.top_logprobs or [])})
    return lp


def _completion_response(st: ServerState, plan: Plan, choices: list[_Choice], rid: str) -> Completion:
    tok = st.lm.tokenizer
    out = [CompletionChoice(index=c.index, text=plan.echo + c.text, finish_reason=_finish_reason(c, 0),
                            logprobs=_completion_logprobs(tok, c.logprobs, len(plan.echo))
                            if plan.params.logprobs else None) for c in choices]
    return Completion(id=rid, model=st.served_id, choices=out, usage=_usage(choices))


async def _merged_events(request: Request, choices: list[_Choice]):
    """Events of all choices as they come: (choice, event); stops when all finished."""
    pending = {asyncio.ensure_future(c.queue.get()): c for c in choices}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if await request.is_disconnected():
                    return
                continue
            for fut in done:
                c = pending.pop(fut)
                ev = fut.result()
                if isinstance(ev, FinishEvent):
                    c.finish = ev  # before the consumer sees it: it reports c.finish's reason
                else:
                    if c.first_at is None:
                        c.first_at = time.monotonic()
                    pending[asyncio.ensure_future(c.queue.get())] = c
                yield c, ev
    finally:
        for fut in pending:
            fut.cancel()


def _chunk(st, rid, index, delta: ChatDelta, finish=None, logprobs=None) -> str:
    return ChatCompletionChunk(id=rid, model=st.served_id, choices=[ChatChunkChoice(
        index=index, delta=delta, finish_reason=finish, logprobs=logprobs)]).model_dump_json(exclude_none=True)


async def _stream_chat(st, request, plan, choices, rid, include_usage):
    tok = st.lm.tokenizer
    try:
        for c in choices:
            yield _chunk(st, rid, c.index, ChatDelta(role="assistant", content=""))
        async for c, ev in _merged_events(request, choices):
            if isinstance(ev, FinishEvent) and ev.reason == "error":
                yield errors.error_event(APIError(500, f"generation failed: {ev.error}", code="engine_error"))
                continue
            events = c.feed(ev.text, final=isinstance(ev, FinishEvent))
            lp = ChoiceLogprobs(content=[_chat_logprob(tok, ev)]) \
                if isinstance(ev, TokenEvent) and ev.logprob is not None else None
            for d in _deltas(events, plan.parallel):
                yield _chunk(st, rid, c.index, d, logprobs=lp)
                lp = None
            if lp is not None:
                yield _chunk(st, rid, c.index, ChatDelta(), logprobs=lp)
            if isinstance(ev, FinishEvent):
                yield _chunk(st, rid, c.index, ChatDelta(), finish=_finish_reason(c, len(c.parser.calls)))
        if include_usage and all(c.finish for c in choices):
            yield ChatCompletionChunk(id=rid, model=st.served_id, choices=[],
                                      usage=_usage(choices)).model_dump_json(exclude_none=True)
        yield "[DONE]"
    finally:
        _release(st, choices)
        _account(st, plan, choices, rid)


async def _stream_response(st, request, plan, choice, builder, conversation):
    try:
        for event in builder.start():
            yield {"event": event["type"], "data": json.dumps(event)}
        async for c, ev in _merged_events(request, [choice]):
            if isinstance(ev, FinishEvent) and ev.reason == "error":
                err = {"type": "error", "code": "engine_error", "message": f"generation failed: {ev.error}",
                       "param": None, "sequence_number": builder._seq + 1}
                yield {"event": "error", "data": json.dumps(err)}
                return
            events = c.feed(ev.text, final=isinstance(ev, FinishEvent))
            out = builder.feed(events, plan.parallel)
            if isinstance(ev, FinishEvent):
                out += builder.finish(ev.reason, usage_of(ev))
            for event in out:
                yield {"event": event["type"], "data": json.dumps(event)}
        if builder.req.store and choice.finish is not None:
            st.responses.put(builder.id, conversation + builder.messages())
    finally:
        _release(st, [choice])
        _account(st, plan, [choice], builder.id)


def _deltas(events, parallel: bool):
    for e in events:
        if e.kind in ("call_start", "call_args") and e.index > 0 and not parallel:
            continue
        if e.kind == "reasoning" and e.text:
            yield ChatDelta(reasoning_content=e.text)
        elif e.kind == "content" and e.text:
            yield ChatDelta(content=e.text)
        elif e.kind == "call_start":
            yield ChatDelta(tool_calls=[ToolCallDelta(index=e.index, id=new_id("call"), type="function",
                                                      function={"name": e.name, "arguments": ""})])
        elif e.kind == "call_args":
            yield ChatDelta(tool_calls=[ToolCallDelta(index=e.index, function={"arguments": e.text})])


async def _stream_completion(st, request, plan, choices, rid, include_usage):
    tok = st.lm.tokenizer
    try:
        if plan.echo:
            for c in choices:
                yield Completion(id=rid, model=st.served_id, choices=[CompletionChoice(
                    index=c.index, text=plan.echo, finish_reason=None)]).model_dump_json(exclude_none=True)
        async for c, ev in _merged_events(request, choices):
            finish = _finish_reason(c, 0) if isinstance(ev, FinishEvent) else None
            lp = _completion_logprobs(tok, [ev], 0) if isinstance(ev, TokenEvent) and ev.logprob is not None else None
            if ev.text or finish or lp:
                yield Completion(id=rid, model=st.served_id, choices=[CompletionChoice(
                    index=c.index, text=ev.text, finish_reason=finish, logprobs=lp)]).model_dump_json(exclude_none=True)
        if include_usage and all(c.finish for c in choices):
            yield Completion(id=rid, model=st.served_id, choices=[],
                             usage=_usage(choices)).model_dump_json(exclude_none=True)
        yield "[DONE]"
    finally:
        _release(st, choices)
        _account(st, plan, choices, rid)
