"""Whole-text parsing of what a Qwen-family model writes: reasoning, content and tool calls.

Two tool-call formats, chosen from the chat template: Qwen3.5's XML form
(`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`)
and the JSON form of earlier Qwen checkpoints (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`).
Argument values are converted by the offered function's JSON schema. A call written inside
`<think>` still counts as a call. The server's streaming parsers build on these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # malformed calls, kept out of content


MARKUP = ("<tool_call>", "</tool_call>", "<function=")


def leaks_markup(text: str) -> bool:
    """Tool-call markup in what should be plain text: the failure of uniformly quantized
    Qwen3.5 (the server counts it as markup_in_content; the evals and the soak break on it)."""
    return any(m in text for m in MARKUP)


def _schema_of(tools: list[dict] | None, name: str) -> dict:
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return fn.get("parameters") or {}
    return {}


def convert_value(raw: str, schema: dict | None) -> Any:
    """A parameter's text converted to the type its JSON schema asks for (text when unsure)."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    text = raw.strip()
    if text == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            value = json.loads(text)
            return value if isinstance(value, int) else int(float(text)) if float(text).is_integer() else raw
        if kind == "number":
            value = json.loads(text)
            return value if isinstance(value, (int, float)) else raw
        if kind == "boolean":
            return {"true": True, "false": False}.get(text.lower(), raw)
        if kind in ("object", "array"):
            return json.loads(text)
    except (ValueError, TypeError):
        return raw
    return raw


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)(?:\n?</parameter>|(?=<parameter=)|$)", re.S)


class XmlToolParser:
    """Qwen3.5 / Qwen3-Coder: `<function=NAME>` with one `<parameter=ARG>` block per argument."""

    name = "qwen3_xml"

    def parse_call(self, body: str, tools: list[dict] | None) -> ToolCall:
        match = _FUNCTION.search(body)
        if not match:
            raise ValueError("no <function=NAME> block")
        name = match.group(1).strip()
        props = _schema_of(tools, name).get("properties") or {}
        args = {}
        for pm in _PARAMETER.finditer(match.group(2)):
            key = pm.group(1).strip()
            args[key] = convert_value(pm.group(2), props.get(key))
        return ToolCall(name=name, arguments=args)


class JsonToolParser:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3)."""

    name = "qwen_json"

    def parse_call(self, body: str, tools: list[dict] | None) -> ToolCall:
        obj = json.loads(body.strip())
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("tool call JSON has no \"name\"")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError("tool call arguments are not an object")
        return ToolCall(name=obj["name"], arguments=args)


PARSERS = {p.name: p for p in (XmlToolParser(), JsonToolParser())}


def parser_for_template(chat_template: str | None) -> XmlToolParser | JsonToolParser:
    """The template shows the model's own call format; XML when it mentions `<function=`."""
    if chat_template and "<function=" in chat_template:
        return PARSERS["qwen3_xml"]
    return PARSERS["qwen_json"]


@dataclass
class OutputEvent:
    """One piece of parsed output: kind is reasoning, content, call_start, call_args or error."""
    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class StreamingOutputParser:
    """Splits generated text, as it arrives, into reasoning, content and tool calls.

    Markup is held back until it is unambiguous, so no `<tool_call>` or `<think>` text ever
    reaches content; a tool call is announced (name) as soon as `<function=NAME>` is complete and
    its arguments are released, typed by the schema, when its block closes. Feeding a whole text
    at once gives exactly the result of feeding it piece by piece.
    """

    def __init__(self, parser, tools: list[dict] | None, prompt_opened_think: bool,
                 parse_tools: bool = True):
        self.parser = parser
        self.tools = tools
        self.parse_tools = bool(tools) and parse_tools
        self.mode = "reasoning" if prompt_opened_think else "start"
        self.return_mode = "content"
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.announced = False
        self.content_started = False
        self.pending_ws = ""

    def _offered(self, name: str) -> bool:
        return any((t.get("function") or t).get("name") == name for t in self.tools or [])

    def _content(self, text: str, final: bool = False) -> list[OutputEvent]:
        if not self.content_started:
            text = text.lstrip()
            if not text:
                return []
            self.content_started = True
        text = self.pending_ws + text
        stripped = text if final else text.rstrip()
        self.pending_ws = "" if final else text[len(stripped):]
        return [OutputEvent("content", stripped)] if stripped else []

    def feed(self, delta: str) -> list[OutputEvent]:
        self.buf += delta
        return self._drain(final=False)

    def finish(self) -> list[OutputEvent]:
        events = self._drain(final=True)
        if self.mode == "tool":
            events += self._close_call(self.buf)
            self.buf = ""
        elif self.buf:
            kind = "reasoning" if self.mode == "reasoning" else "content"
            events += ([OutputEvent("reasoning", self.buf)] if kind == "reasoning"
                       else self._content(self.buf, final=False))
            self.buf = ""
        return events

    def _close_call(self, body: str) -> list[OutputEvent]:
        index = len(self.calls)
        try:
            call = self.parser.parse_call(body, self.tools)
        except (ValueError, json.JSONDecodeError) as exc:
            self.announced = False
            return [OutputEvent("error", f"unparsable tool call: {exc}", index=index)]
        if not self._offered(call.name):  # never hand a client a function it did not offer
            self.announced = False
            return [OutputEvent("error", f"tool call names {call.name!r}, which is not an offered "
                                "tool; dropped", index=index)]
        self.calls.append(call)
        events = [] if self.announced else [OutputEvent("call_start", index=index, name=call.name)]
        self.announced = False
        return events + [OutputEvent("call_args", json.dumps(call.arguments, ensure_ascii=False),
                                     index=index, name=call.name)]

    def _drain(self, final: bool) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        while self.buf:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf = head[len(THINK_OPEN):]
                    self.mode = "reasoning"
                    continue
                if not final and THINK_OPEN.startswith(head):
                    break  # could still become <think>
                self.mode = "content"
                continue
            if self.mode == "reasoning":
                ends = [(self.buf.find(THINK_CLOSE), THINK_CLOSE)]
                if self.parse_tools:
                    ends.append((self.buf.find(CALL_OPEN), CALL_OPEN))
                found = [(i, m) for i, m in ends if i != -1]
                if found:
                    i, marker = min(found)
                    if i:
                        events.append(OutputEvent("reasoning", self.buf[:i]))
                    self.buf = self.buf[i + len(marker):]
                    if marker == THINK_CLOSE:
                        self.buf = self.buf.lstrip("\n")
                        self.mode = "content"
                    else:
                        self.return_mode, self.mode = "reasoning", "tool"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, tuple(m for _, m in ends))
                if len(self.buf) > keep:
                    events.append(OutputEvent("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.mode == "content":
                i = self.buf.find(CALL_OPEN) if self.parse_tools else -1
                if i != -1:
                    events += self._content(self.buf[:i])
                    self.buf = self.buf[i + len(CALL_OPEN):]
                    self.return_mode, self.mode = "content", "tool"
                    continue
                keep = 0 if (final or not self.parse_tools) else _partial_suffix(self.buf, (CALL_OPEN,))
                if len(self.buf) > keep:
                    events += self._content(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.mode == "tool":
                end = self.buf.find(CALL_CLOSE)
                if not self.announced:
                    m = re.search(r"<function=([^>\n]+)>", self.buf)
                    if m and self._offered(m.group(1).strip()):
                        self.announced = True
                        events.append(OutputEvent("call_start", index=len(self.calls),
                                                  name=m.group(1).strip()))
                if end == -1:
                    break
                events += self._close_call(self.buf[:end])
                self.buf = self.buf[end + len(CALL_CLOSE):]
                self.mode = self.return_mode
                continue
        return events


def parse_output(text: str, parser, tools: list[dict] | None, prompt_opened_think: bool) -> ParsedOutput:
    """Whole-text parse: the streaming parser fed in one piece, so both paths always agree."""
    sp = StreamingOutputParser(parser, tools, prompt_opened_think)
    events = sp.feed(text) + sp.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning").strip() or None
    content = "".join(e.text for e in events if e.kind == "content").strip()
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=list(sp.calls),
                        errors=[e.text for e in events if e.kind == "error"])
