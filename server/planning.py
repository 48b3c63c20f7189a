"""Request planning: an OpenAI request becomes token ids, sampling parameters and an optional
grammar (what the engine needs), with every check that can reject it before work is done."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mixbit.models.chat.grammar import CompiledGrammar, GrammarError, chat_grammar
from mixbit.models.chat.template import prompt_opens_think, render_chat
from mixbit.models.chat.toolcall import parser_for_template

from .errors import APIError
from .middleware import reject_invalid_unicode
from .protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .state import ServerState


def reject_unsupported(req) -> None:
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
              top_logprobs: int, prompt_param: str = "messages",
              max_param: str = "max_tokens") -> SamplingParams:
    g = st.settings.generation
    room = st.context_length - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                       f"{st.context_length} tokens", param=prompt_param, code="context_length_exceeded")
    limit = st.settings.server.max_prompt_tokens
    if limit and prompt_len > limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens; server.max_prompt_tokens is "
                       f"{limit}", param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"{max_param} ({max_tokens}) plus the prompt ({prompt_len} tokens) "
                       f"exceeds the context of {st.context_length} tokens; at most {room} "
                       "tokens can be generated", param=max_param, code="context_length_exceeded")
    vocab = len(st.lm.hf_tokenizer)
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
        # keeping the k most likely of a vocabulary of at most k tokens keeps them all
        top_k=req.top_k if req.top_k and req.top_k < vocab else 0,
        min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop_list(),
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
                    except (json.JSONDecodeError, RecursionError):
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is "
                                       "not valid JSON", param=f"messages[{i}].tool_calls[{j}]",
                                       code="invalid_value") from None
                if not isinstance(args, dict):
                    raise APIError(400, "tool call arguments must be a JSON object",
                                   param=f"messages[{i}].tool_calls[{j}]", code="invalid_value")
                reject_invalid_unicode(args, f"messages[{i}].tool_calls[{j}].function.arguments")
                calls.append({"type": "function", "id": c.id,
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def render_prompt(st: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int], list[dict] | None]:
    """The chat template's text for a request, its token ids, and the tools it rendered."""
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
    return text, st.lm.tokenizer.encode(text, add_special_tokens=False), render_tools


def chat_plan(st: ServerState, req: ChatCompletionRequest, fit_max_tokens: bool = False) -> Plan:
    """`fit_max_tokens`: a max_tokens past the context is a cap, lowered to what fits (Anthropic's
    clients send their own model's output limit), not an error."""
    choice = req.tool_choice
    text, ids, render_tools = render_prompt(st, req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if fit_max_tokens and max_tokens is not None:
        max_tokens = max(1, min(max_tokens, st.context_length - len(ids)))
    params = _sampling(st, req, max_tokens, len(ids), req.top_logprobs or 0,
                       max_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens")
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


def completion_plans(st: ServerState, req: CompletionRequest) -> list[Plan]:
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    vocab = len(st.lm.hf_tokenizer)
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
        params = _sampling(st, req, req.max_tokens if req.max_tokens is not None else 16, len(ids), top,
                           prompt_param="prompt")
        params.logprobs = req.logprobs is not None and req.logprobs is not False
        plans.append(Plan(kind="completion", prompt_ids=ids, params=params, prompt_text=text,
                          echo=text if req.echo else "", endpoint="/v1/completions"))
    return plans
