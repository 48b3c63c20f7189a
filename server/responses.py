"""OpenAI's Responses API (`POST /v1/responses`) on the chat engine.

What the `openai-agents` SDK and newer OpenAI clients send by default. A request becomes a chat
request (input items -> messages, function tools -> tools, `text.format` -> response_format), runs
through the same planning, grammar, engine and output parser as /v1/chat/completions, and its
parser events become Responses output items: `reasoning`, `message` with `output_text`, and
`function_call`. Streaming emits the Responses event types in order. `previous_response_id` reads
a bounded in-memory store (per process, oldest dropped first).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .middleware import reject_invalid_unicode
from .protocol import Seed, new_id


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: Seed | None = None  # not OpenAI's, but what local servers accept
    background: bool | None = None
    conversation: Any = None


# fields OpenAI accepts that change nothing here
IGNORED = {"include", "truncation", "prompt_cache_key", "safety_identifier", "service_tier",
           "stream_options", "max_tool_calls", "prompt_cache_retention"}


class ResponseStore:
    """The last `capacity` responses: their conversation as chat messages, for continuation."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict] | None:
        with self._lock:
            return self._items.get(rid)


def _field(item: dict, key: str, where: str, kind=str, default=None):
    """item[key] when it has the expected type (or is absent: default); else a 400 naming it."""
    value = item.get(key, default)
    if value is default or isinstance(value, kind):
        return value
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    raise APIError(400, f"{where}.{key} must be of type {names}; got {type(value).__name__}",
                   param=f"{where}.{key}", code="invalid_type")


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts",
                       param=f"{where}.content", code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise APIError(400, f"{here} must be an object", param=here, code="invalid_type")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(_field(part, "text", here, default=""))
        elif kind == "refusal":
            parts.append(_field(part, "refusal", here, default=""))
        else:
            raise APIError(400, f"{where}.content[{j}]: content type {kind!r} is not supported: "
                           "this model reads text only", param=f"{where}.content",
                           code="unsupported_content")
    return "".join(parts)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """Input items as chat messages (without instructions)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind is not None and not isinstance(kind, str):
            raise APIError(400, f"{where}.type must be a string", param=f"{where}.type",
                           code="invalid_type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant",
                               param=f"{where}.role", code="invalid_value")
            msg = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            try:
                args = json.loads(_field(item, "arguments", where) or "{}")
                reject_invalid_unicode(args, f"{where}.arguments")
            except (json.JSONDecodeError, RecursionError):
                raise APIError(400, f"{where}.arguments is not valid JSON", param=f"{where}.arguments",
                               code="invalid_value") from None
            call = {"id": _field(item, "call_id", where) or new_id("call"), "type": "function",
                    "function": {"name": _field(item, "name", where, default=""),
                                 "arguments": json.dumps(args)}}
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, where) if isinstance(output, list) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": output})
        elif kind == "reasoning":
            parts = _field(item, "content", where, list) or _field(item, "summary", where, list) or []
            texts = [_text_of([part], where) for part in parts]
            reasoning = "\n".join(t for t in texts if t) or None
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported (supported: "
                           "message, function_call, function_call_output, reasoning)",
                           param=where, code="unsupported_input")
    return out


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion request equivalent to a Responses request."""
    extra = req.model_extra or {}
    for name in extra:
        if name not in IGNORED:
            raise APIError(400, f"{name} is not supported by this server's Responses API",
                           param=name, code="unsupported_parameter")
    if req.background:
        raise APIError(400, "background responses are not supported", param="background",
                       code="unsupported_parameter")
    if req.conversation is not None:
        raise APIError(400, "conversations are not stored here; send previous_response_id or the "
                       "whole input", param="conversation", code="unsupported_parameter")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req)
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: tool type {t.get('type')!r} is not supported; only "
                           "function tools run here", param=f"tools[{i}]", code="unsupported_tool")
        tools.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": False}
    if tools:
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "name": ...}', param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = _field(req.text or {}, "format", "text", dict)
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt and fmt.get("type") in ("json_object", "text"):
        body["response_format"] = {"type": fmt["type"]}
    elif fmt:
        raise APIError(400, f"text.format type {fmt.get('type')!r} is not supported",
                       param="text.format", code="invalid_value")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("seed", "seed"), ("user", "user")):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    if req.top_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs
    return body


def responses_param(chat_param: str) -> str:
    """The Responses request's name for a field of the chat request it became."""
    m = re.match(r"tools\[(\d+)\]\.function(.*)", chat_param)
    if m:
        return f"tools[{m.group(1)}]{m.group(2)}"
    for chat, ours in (("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
                       ("messages", "input"), ("chat_template_kwargs", "reasoning")):
        if chat_param == chat or chat_param.startswith(chat + "[") or chat_param.startswith(chat + "."):
            return ours
    return chat_param


class ResponseBuilder:
    """Turns parser events into Responses output items and, when streaming, events."""

    def __init__(self, req: ResponsesRequest, model: str, rid: str | None = None):
        self.req = req
        self.id = rid or new_id("resp")
        self.model = model
        self.created = int(time.time())
        self.output: list[dict] = []
        self._open: dict | None = None  # the item receiving deltas
        self.sequence_number = 0

    # ----------------------------------------------------------------- the response object
    def response(self, status: str = "in_progress", usage: dict | None = None,
                 incomplete: str | None = None) -> dict:
        req = self.req
        tools = [t for t in (req.tools or [])]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output, "instructions": req.instructions,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": tools, "truncation": "disabled",
            "usage": usage, "user": req.user,
        }

    def _event(self, kind: str, **data) -> dict:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number, **data}

    def start(self) -> list[dict]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # ----------------------------------------------------------------- items
    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        idx = self.output.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                content_index=0, part=part)]
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=idx, arguments=item["arguments"]))
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=idx, content_index=0,
                                   text=item["content"][0]["text"]))
        out.append(self._event("response.output_item.done", output_index=idx, item=item))
        return out

    def _open_item(self, item: dict) -> list[dict]:
        out = self._close()
        self.output.append(item)
        self._open = item
        idx = len(self.output) - 1
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        out.append(self._event("response.output_item.added", output_index=idx, item=added))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=idx, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def feed(self, events, parallel: bool = True) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind in ("call_start", "call_args") and e.index > 0 and not parallel:
                continue
            if e.kind == "reasoning" and e.text:
                if not self._open or self._open["type"] != "reasoning":
                    out += self._open_item({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                            "content": [{"type": "reasoning_text", "text": ""}],
                                            "status": "in_progress"})
                self._open["content"][0]["text"] += e.text
                out.append(self._event("response.reasoning_text.delta", item_id=self._open["id"],
                                       output_index=len(self.output) - 1, content_index=0,
                                       delta=e.text))
            elif e.kind == "content" and e.text:
                if not self._open or self._open["type"] != "message":
                    out += self._open_item({"type": "message", "id": new_id("msg"), "role": "assistant",
                                            "status": "in_progress", "content": [
                                                {"type": "output_text", "text": "", "annotations": [],
                                                 "logprobs": []}]})
                self._open["content"][0]["text"] += e.text
                out.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                       output_index=len(self.output) - 1, content_index=0,
                                       delta=e.text, logprobs=[]))
            elif e.kind == "call_start":
                out += self._open_item({"type": "function_call", "id": new_id("fc"),
                                        "call_id": new_id("call"), "name": e.name, "arguments": "",
                                        "status": "in_progress"})
            elif e.kind == "call_args" and self._open and self._open["type"] == "function_call":
                self._open["arguments"] += e.text
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self._open["id"], output_index=len(self.output) - 1,
                                       delta=e.text))
        return out

    def finish(self, reason: str, usage: dict) -> list[dict]:
        out = self._close()
        incomplete = "max_output_tokens" if reason == "length" else None
        final = self.response("incomplete" if incomplete else "completed", usage, incomplete)
        out.append(self._event("response.incomplete" if incomplete else "response.completed",
                               response=final))
        return out

    def messages(self) -> list[dict]:
        """This response's output as chat messages, for previous_response_id."""
        out: list[dict] = []
        reasoning = None
        for item in self.output:
            if item["type"] == "reasoning":
                reasoning = item["content"][0]["text"]
            elif item["type"] == "message":
                msg = {"role": "assistant", "content": item["content"][0]["text"]}
                if reasoning:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
            elif item["type"] == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                    if reasoning:
                        msg["reasoning_content"], reasoning = reasoning, None
                    out.append(msg)
        return out


def usage_of(finish) -> dict:
    return {"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}

