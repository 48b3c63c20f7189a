"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat
engine.

What Claude Code, the `anthropic` SDK and agent frameworks built on it send when pointed at
`ANTHROPIC_BASE_URL`. A request becomes a chat request (system + messages with `text`,
`tool_use`, `tool_result` and `thinking` blocks -> chat messages, `input_schema` tools -> function
tools, `tool_choice` any/tool -> required/named, forced by the grammar) and runs through the same
planning, prompt cache, grammar, engine, output parser, metrics and fidelity checks as
/v1/chat/completions; its parser events become content blocks (`thinking`, `text`, `tool_use`)
and, streamed, Anthropic's events in order. Errors take Anthropic's shape on these routes
(errors.py). `thinking.budget_tokens` is a real budget: past it the engine forces `</think>`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .middleware import reject_invalid_unicode
from .protocol import new_id

# fields Anthropic accepts that change nothing here (Claude Code sends some of them)
IGNORED = {"service_tier", "container", "mcp_servers", "context_management", "betas"}


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


def _bad(message: str) -> APIError:
    return APIError(400, message, code="invalid_request_error")


def _blocks(content: list, where: str):
    """(path, type, block) for each block of a content list; not a list is a clear 400."""
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    for j, block in enumerate(content):
        yield f"{where}[{j}]", block.get("type") if isinstance(block, dict) else None, block


def _text_of(block: dict, here: str) -> str:
    text = block.get("text", "")
    if not isinstance(text, str):
        raise _bad(f"{here}.text: must be a string")
    return text


def _text_blocks(content, where: str) -> str:
    """The text of a string or a list of text blocks; anything else is a clear 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for here, kind, block in _blocks(content, where):
        if kind != "text":
            raise _bad(_unsupported(kind, here))
        parts.append(_text_of(block, here))
    return "".join(parts)


def _unsupported(kind, where: str) -> str:
    if kind in ("image", "document", "file", "container_upload"):
        return f"{where}: {kind} blocks are not supported: this model reads text only"
    return f"{where}: content block type {kind!r} is not supported here"


def _user_messages(content, where: str) -> list[dict]:
    """A user turn: its tool_result blocks become tool messages, its text a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    text: list[str] = []
    for here, kind, block in _blocks(content, f"{where}.content"):
        if kind == "text":
            text.append(_text_of(block, here))
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{here}.tool_use_id: this field is required")
            result = _text_blocks(block.get("content"), f"{here}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise _bad(_unsupported(kind, here))
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_message(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, thinking, calls = [], [], []
    for here, kind, block in _blocks(content, f"{where}.content"):
        if kind == "text":
            text.append(_text_of(block, here))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing to read
        elif kind == "tool_use":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{here}.input: must be an object")
            reject_invalid_unicode(args, f"{here}.input")
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise _bad(f"{here}.name: this field is required")
            calls.append({"id": block.get("id") or new_id("toolu"), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}})
        else:
            raise _bad(_unsupported(kind, here))
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def chat_messages(req: CountTokensRequest) -> list[dict]:
    system = _text_blocks(req.system, "system")
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user_messages(m.get("content"), where)
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), where))
        else:
            raise _bad(f"{where}.role: must be user or assistant (the system prompt is the "
                       "top-level system field)")
    return out


_BASH = {
    "description": "Run a command in a persistent bash shell; restart: true starts a new shell.",
    "input_schema": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the shell instead."}}},
}


def _editor(undo: bool) -> dict:
    commands = ["view", "create", "str_replace", "insert"] + (["undo_edit"] if undo else [])
    return {
        "description": "View, create and edit text files: view a file or directory, create a file, "
                       "replace a unique string, insert text after a line" + (", undo the last edit"
                                                                             if undo else "") + ".",
        "input_schema": {"type": "object", "required": ["command", "path"], "properties": {
            "command": {"type": "string", "enum": commands},
            "path": {"type": "string", "description": "Absolute path of the file or directory."},
            "file_text": {"type": "string", "description": "create: the file's content."},
            "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
            "new_str": {"type": "string", "description": "str_replace: the new text; insert: the text."},
            "insert_line": {"type": "integer", "description": "insert: the line to insert after."},
            "view_range": {"type": "array", "items": {"type": "integer"},
                           "description": "view: [first, last] line (last -1: to the end)."}}},
    }


# Anthropic-defined client tools (the client runs them; the API knows their schema), by type:
# the name Anthropic requires and the schema its clients send inputs in.
CLIENT_TOOLS = {
    "bash_20241022": ("bash", _BASH), "bash_20250124": ("bash", _BASH),
    "text_editor_20241022": ("str_replace_editor", _editor(True)),
    "text_editor_20250124": ("str_replace_editor", _editor(True)),
    "text_editor_20250429": ("str_replace_based_edit_tool", _editor(False)),
    "text_editor_20250728": ("str_replace_based_edit_tool", _editor(False)),
}


def _tools(req: CountTokensRequest) -> list[dict]:
    tools = []
    for i, t in enumerate(req.tools or []):
        kind = t.get("type")
        if kind in CLIENT_TOOLS:
            name, spec = CLIENT_TOOLS[kind]
            if t.get("name") != name:
                raise _bad(f"tools[{i}].name: a {kind} tool is named {name!r}")
            tools.append({"type": "function", "function": {"name": name, **{
                "description": spec["description"], "parameters": spec["input_schema"]}}})
            continue
        if kind not in (None, "custom"):
            raise _bad(f"tools[{i}]: tool type {kind!r} is not supported (a server tool runs on "
                       "Anthropic's side); define the tool with name, description and input_schema, "
                       f"or use a client tool type: {', '.join(CLIENT_TOOLS)}")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools[{i}]: name and input_schema are required")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def chat_body(req: CountTokensRequest, think_end: tuple[int, ...] = ()) -> tuple[dict, int]:
    """The chat completion request equivalent to a Messages request, and its thinking budget
    (0: none)."""
    for name in req.model_extra or {}:
        if name not in IGNORED:
            raise _bad(f"{name}: not a field of the Messages API")
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": False}
    tools = _tools(req)
    if tools:
        body["tools"] = tools
    choice = req.tool_choice or {}
    kind = choice.get("type")
    forced = kind in ("any", "tool")
    if kind == "auto" or (kind is None and choice == {}):
        pass
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: this field is required with type tool")
        if choice["name"] not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice.name: no tool named {choice['name']!r} in tools")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind == "none":
        body["tool_choice"] = "none"
    else:
        raise _bad("tool_choice.type: must be auto, any, tool or none")
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    thinking = req.thinking or {"type": "disabled"}
    budget = 0
    if thinking.get("type") in ("enabled", "adaptive"):
        if forced:
            raise _bad("thinking may not be enabled when tool_choice forces tool use")
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            max_tokens = getattr(req, "max_tokens", None)
            if not isinstance(budget, int) or budget < 1:
                raise _bad("thinking.budget_tokens: an integer >= 1 is required")
            if max_tokens is not None and budget >= max_tokens:
                raise _bad(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                           f"({max_tokens})")
        body["chat_template_kwargs"] = {"enable_thinking": True}
    elif thinking.get("type") == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    else:
        raise _bad("thinking.type: must be enabled or disabled")
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        user = (req.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
    return body, budget if think_end else 0


def stop_reason(finish, calls: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for an engine finish."""
    reason = finish.reason if finish else "stop"
    if reason in ("length", "timeout"):
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if finish is not None and finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return "end_turn", None


def usage_of(finish) -> dict:
    """Anthropic counts cached prompt tokens apart: input_tokens is what was not cached."""
    prompt = finish.prompt_tokens if finish else 0
    cached = finish.cached_tokens if finish else 0
    return {"input_tokens": prompt - cached, "output_tokens": finish.completion_tokens if finish else 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessageBuilder:
    """Turns parser events into content blocks and, when streaming, Anthropic's events."""

    def __init__(self, model: str, prompt_tokens: int, parallel: bool = True):
        self.id = new_id("msg")
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.parallel = parallel
        self.content: list[dict] = []
        self._args: dict[int, str] = {}  # tool_use block index -> its JSON so far
        self._open: int | None = None  # index of the block receiving deltas
        self.calls = 0

    def message(self, stop: tuple[str | None, str | None] = (None, None), usage: dict | None = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage or {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message()}, {"type": "ping"}]

    def _close(self) -> list[dict]:
        i, self._open = self._open, None
        if i is None:
            return []
        block = self.content[i]
        if block["type"] == "tool_use":
            raw = self._args.pop(i, "")
            try:
                block["input"] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                block["input"] = {}
        return [{"type": "content_block_stop", "index": i}]

    def _open_block(self, block: dict) -> list[dict]:
        out = self._close()
        self.content.append(block)
        self._open = len(self.content) - 1
        return out + [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._open, "delta": delta}

    def feed(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind in ("call_start", "call_args") and e.index > 0 and not self.parallel:
                continue
            kind = self.content[self._open]["type"] if self._open is not None else None
            if e.kind == "reasoning" and e.text:
                if kind != "thinking":
                    out += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
                self.content[self._open]["thinking"] += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif e.kind == "content" and e.text:
                if kind != "text":
                    if kind is None and not e.text.strip() and not self.content:
                        continue  # the blank line after </think>: not a block of its own
                    out += self._open_block({"type": "text", "text": ""})
                self.content[self._open]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif e.kind == "call_start":
                self.calls += 1
                out += self._open_block({"type": "tool_use", "id": new_id("toolu"), "name": e.name,
                                         "input": {}})
                self._args[self._open] = ""
            elif e.kind == "call_args" and kind == "tool_use":
                self._args[self._open] += e.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def finish(self, finish) -> list[dict]:
        out = self._close()
        # text after a tool call that is only whitespace is not an answer of its own
        self.content = [b for b in self.content if b["type"] != "text" or b["text"].strip() or
                        not self.calls] or self.content
        reason, sequence = stop_reason(finish, self.calls)
        usage = usage_of(finish)
        out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage})
        out.append({"type": "message_stop"})
        self.final = self.message((reason, sequence), usage)
        return out
