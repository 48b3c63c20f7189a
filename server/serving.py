"""Running planned requests on the engine: admission, collection, streaming (chat, completions,
Responses), the OpenAI response shapes, and the per-request accounting (metrics, fidelity)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from mixbit.models.chat.toolcall import StreamingOutputParser, leaks_markup, parser_for_template

from . import errors
from .engine import FinishEvent, TokenEvent, async_emitter
from .errors import APIError
from .fidelity import Job
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                       ChatDelta, ChoiceLogprobs, Completion, CompletionChoice, CompletionLogprobs,
                       FunctionCallOut, PromptTokensDetails, TokenLogprob, ToolCallDelta, ToolCallOut,
                       TopLogprob, Usage, new_id)
from .planning import Plan
from .responses import usage_of

if TYPE_CHECKING:
    from .state import ServerState

log = logging.getLogger("mixbit.server")


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
    piece = tokenizer.convert_ids_to_tokens(token_id)
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


def start_choices(st: ServerState, plan: Plan, n: int, index_base: int = 0) -> list[_Choice]:
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


async def run_plan(st: ServerState, request: Request, plan: Plan, n: int, stream: bool,
               include_usage: bool, index_base: int = 0):
    choices = start_choices(st, plan, n, index_base)
    rid = new_id("chatcmpl" if plan.kind == "chat" else "cmpl")
    if stream:
        gen = _stream_chat(st, request, plan, choices, rid, include_usage) if plan.kind == "chat" \
            else _stream_completion(st, request, plan, choices, rid, include_usage)
        return EventSourceResponse(gen, ping=15, send_timeout=30)
    try:
        await collect(request, st, choices)
    finally:
        release(st, choices)
    out = _chat_response(st, plan, choices, rid) if plan.kind == "chat" else \
        _completion_response(st, plan, choices, rid)
    account(st, plan, choices, rid)
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


def _valid_json(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON that validates against `schema`."""
    try:
        return _valid(json.loads(text), schema)
    except ValueError:
        return False


def account(st: ServerState, plan: Plan, choices: list[_Choice], rid: str) -> None:
    """Metrics of finished choices, and their offer to the fidelity worker."""
    m = st.metrics
    if m is None:
        return
    now = time.monotonic()
    for c in choices:
        f = c.finish
        if f is None:
            continue
        v = st.variant
        m.e2e.labels(plan.endpoint, v).observe(now - c.started)
        if c.first_at is not None:
            m.ttft.labels(plan.endpoint, v).observe(c.first_at - c.started)
        m.prompt_tokens.labels(v).inc(max(f.prompt_tokens - f.cached_tokens, 0))
        m.cached_tokens.labels(v).inc(f.cached_tokens)
        m.generation_tokens.labels(v).inc(f.completion_tokens)
        kind = "completion"
        if plan.kind == "chat":
            kind = "chat"
            calls = c.parser.calls if c.parser else []
            if plan.tools:
                if calls:
                    kind = "tool_call"
                    m.tool_calls.labels("parsed", v).inc(len(calls))
                if c.parse_errors:
                    m.tool_calls.labels("parse_failed", v).inc(c.parse_errors)
                if leaks_markup(c.content):
                    m.tool_calls.labels("markup_in_content", v).inc()
                if plan.forced_tools and not calls and f.reason == "stop":
                    m.tool_calls.labels("forced_without_call", v).inc()
                if plan.grammar is not None:
                    for call in calls:
                        fn = next((t["function"] for t in plan.tools
                                   if t["function"]["name"] == call.name), {})
                        if (plan.forced_tools or fn.get("strict")) and fn.get("parameters") and \
                                not _valid(call.arguments, fn["parameters"]):
                            m.constrained_invalid.labels("tool_arguments", v).inc()
            if plan.json_schema is not None and not calls:
                kind = "json"
                if f.reason == "stop" and not _valid_json(c.content, plan.json_schema):
                    m.constrained_invalid.labels("json", v).inc()
        if st.fidelity is not None and f.reason in ("stop", "length"):
            st.fidelity.offer(Job(kind, plan.prompt_ids, f.tokens, rid, grammar=plan.grammar,
                                  variant=v, model=st.lm.model))
        if st.mirror is not None and plan.kind == "chat" and f.reason in ("stop", "length") and \
                random.random() < st.settings.fidelity.mirror_rate:
            task = asyncio.get_running_loop().create_task(mirror(st, plan, c))
            _MIRRORS.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(_MIRRORS.discard)


def release(st: ServerState, choices: list[_Choice]) -> None:
    for c in choices:
        if c.finish is None:
            st.engine.cancel(c.seq, "cancelled")
    st.inflight -= len(choices)


_MIRRORS: set[asyncio.Task] = set()


async def mirror(st: ServerState, plan: Plan, original: _Choice) -> None:
    """Re-runs a finished chat request on `st.mirror` (same prompt, sampling and grammar), off the
    client's path, and counts how the two outputs compare. A busy mirror drops it (counted)."""
    target, m = st.mirror, st.metrics
    labels = (st.variant, target.variant)
    if target.engine.stats.waiting:  # mirrored work never queues ahead of real requests
        m.mirror.labels(*labels, "dropped_busy").inc()
        return
    try:
        (c,) = start_choices(target, plan, 1)
    except APIError:
        m.mirror.labels(*labels, "dropped_busy").inc()
        return
    try:
        while c.finish is None:
            ev = await c.queue.get()
            c.text += ev.text
            if isinstance(ev, FinishEvent):
                c.finish = ev
        if c.finish.reason not in ("stop", "length"):
            raise RuntimeError(c.finish.error or c.finish.reason)
        c.feed(c.text, final=True)
        outcome = compare_outputs(plan, original, c)
    except Exception as exc:  # noqa: BLE001 - a failed mirror is counted, never seen by a client
        log.warning("mirror of a %s request on %s failed: %s", st.variant, target.variant, exc)
        outcome = "mirror_error"
    finally:
        release(target, [c])
    m.mirror.labels(*labels, outcome).inc()


def compare_outputs(plan: Plan, a: _Choice, b: _Choice) -> str:
    """How the mirror's output `b` compares with the served `a` (what a user of the served variant
    would notice: a call or none, which function, which arguments, valid JSON, the same text)."""
    calls_a = a.parser.calls if a.parser else []
    calls_b = b.parser.calls if b.parser else []
    if plan.tools and (calls_a or calls_b):
        if bool(calls_a) != bool(calls_b):
            return "call_vs_no_call"
        if [x.name for x in calls_a] != [x.name for x in calls_b]:
            return "different_function"
        if [x.arguments for x in calls_a] != [x.arguments for x in calls_b]:
            return "different_arguments"
        return "same_call"
    same = a.content.strip() == b.content.strip()
    if plan.json_schema is not None:
        if not _valid_json(b.content, plan.json_schema):
            return "mirror_json_invalid"
        return "same_text" if same else "json_valid_different"
    return "same_text" if same else "different_text"


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


def generation_error(finish: FinishEvent) -> APIError:
    """A request the engine ended with an error: 500 when it failed alone, 503 (retry) when the
    engine restarted under it."""
    if finish.status == 503:
        return APIError(503, f"generation was interrupted: {finish.error}", code="engine_restarted",
                        headers={"Retry-After": "1"})
    return APIError(500, f"generation failed: {finish.error}", code="engine_error")


async def collect(request: Request, st: ServerState, choices: list[_Choice]) -> None:
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
            raise generation_error(c.finish)


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


async def _merged_events(request: Request, choices: list[_Choice], heartbeat: float | None = None):
    """Events of all choices as they come: (choice, event); stops when all finished. With a
    `heartbeat`, (None, None) after each `heartbeat` seconds without an event (a long prefill)."""
    pending = {asyncio.ensure_future(c.queue.get()): c for c in choices}
    quiet_since = time.monotonic()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if await request.is_disconnected():
                    return
                if heartbeat is not None and time.monotonic() - quiet_since >= heartbeat:
                    quiet_since = time.monotonic()
                    yield None, None
                continue
            quiet_since = time.monotonic()
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
                yield errors.error_event(generation_error(ev))
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
        release(st, choices)
        account(st, plan, choices, rid)


async def stream_response(st, request, plan, choice, builder, conversation):
    try:
        for event in builder.start():
            yield {"event": event["type"], "data": json.dumps(event)}
        async for c, ev in _merged_events(request, [choice]):
            if isinstance(ev, FinishEvent) and ev.reason == "error":
                failed = generation_error(ev)
                err = {"type": "error", "code": failed.code, "message": failed.message,
                       "param": None, "sequence_number": builder.sequence_number + 1}
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
        release(st, [choice])
        account(st, plan, [choice], builder.id)


PING_EVERY_S = 5.0  # Anthropic's `ping` while nothing else is sent (a long prompt prefilling)


def _sse(event: dict) -> dict:
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}


async def stream_message(st, request, plan, choice, builder):
    """A Messages API stream: message_start, ping, content blocks, message_delta, message_stop."""
    try:
        for event in builder.start():
            yield _sse(event)
        async for c, ev in _merged_events(request, [choice], heartbeat=PING_EVERY_S):
            if ev is None:
                yield _sse({"type": "ping"})
                continue
            if isinstance(ev, FinishEvent) and ev.reason == "error":
                yield _sse(generation_error(ev).anthropic_body())
                return
            final = isinstance(ev, FinishEvent)
            out = builder.feed(c.feed(ev.text, final=final))
            if final:
                out += builder.finish(ev)
            for event in out:
                yield _sse(event)
    finally:
        release(st, [choice])
        account(st, plan, [choice], builder.id)


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
        release(st, choices)
        account(st, plan, choices, rid)
