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


def split_reasoning(text: str, prompt_opened_think: bool) -> tuple[str | None, str]:
    """(reasoning, rest). The chat template may already have opened `<think>` in the prompt."""
    if prompt_opened_think or text.lstrip().startswith(THINK_OPEN):
        body = text.lstrip()
        if body.startswith(THINK_OPEN):
            body = body[len(THINK_OPEN):]
        if THINK_CLOSE in body:
            reasoning, rest = body.split(THINK_CLOSE, 1)
            return reasoning.strip() or None, rest.lstrip("\n")
        return body.strip() or None, ""  # never closed: all of it was reasoning
    return None, text


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


def extract_tool_calls(text: str, parser, tools: list[dict] | None) -> tuple[str, list[ToolCall], list[str]]:
    """(text with the call blocks removed, calls, errors). An unclosed final block still parses."""
    calls, errors, kept = [], [], []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) != -1:
        kept.append(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN): end if end != -1 else len(text)]
        try:
            calls.append(parser.parse_call(body, tools))
        except (ValueError, json.JSONDecodeError) as exc:
            errors.append(f"unparsable tool call: {exc}")
        pos = len(text) if end == -1 else end + len(CALL_CLOSE)
    kept.append(text[pos:])
    return "".join(kept), calls, errors


def parse_output(text: str, parser, tools: list[dict] | None, prompt_opened_think: bool) -> ParsedOutput:
    reasoning, rest = split_reasoning(text, prompt_opened_think)
    calls: list[ToolCall] = []
    errors: list[str] = []
    if reasoning and CALL_OPEN in reasoning and tools:
        # Qwen3.5 sometimes opens its call before closing </think>; the call is not lost.
        reasoning, calls, errors = extract_tool_calls(reasoning, parser, tools)
        reasoning = reasoning.strip() or None
    content, more, more_errors = extract_tool_calls(rest, parser, tools) if tools else (rest, [], [])
    return ParsedOutput(content=content.strip(), reasoning=reasoning, tool_calls=calls + more,
                        errors=errors + more_errors)
