"""The wire format: pydantic models that mirror OpenAI's API field for field.

Requests accept the fields OpenAI accepts; those mixbit cannot honour are listed in UNSUPPORTED
and rejected with a 400 naming the field, never silently ignored. Fields OpenAI does not define
are ignored (clients and agent frameworks add their own), as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The full 64-bit range: OpenAI's int64 seeds, and unsigned ones (negatives wrap modulo 2**64).
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def check_json_schema(schema: Any) -> None:
    """A ValueError naming what is wrong when `schema` is not a valid JSON Schema (checked
    against the meta-schema of the draft it declares, 2020-12 by default)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON Schema is an object or a boolean; got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
        loop = _ref_loop(schema)
    except RecursionError:
        raise ValueError("the JSON Schema is nested too deeply") from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where}' if where else ''}: "
                         f"{exc.message[:300]}") from None
    if loop:
        raise ValueError(f"the JSON Schema refers to itself without describing any value on the "
                         f"way ({' -> '.join(loop)}); recursion that consumes no input cannot become a grammar")


def _ref_loop(schema: Any) -> list[str] | None:
    """A cycle of `$ref` / allOf / anyOf / oneOf links that never passes through a property or
    an item (e.g. {"$ref": "#"}): as a grammar it recurses forever. Local refs only."""
    def resolve(pointer: str):
        node = schema
        for part in pointer.lstrip("#").strip("/").split("/") if pointer.strip("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def links(pointer: str) -> list[str]:
        node = resolve(pointer)
        if not isinstance(node, dict):
            return []
        out = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out.append("#" + ref[1:] if ref != "#" else "#")
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                out += [f"{pointer.rstrip('/')}/{key}/{i}" for i in range(len(node[key]))]
        return out

    starts = ["#"]
    defs = [(k, schema.get(k)) for k in ("$defs", "definitions") if isinstance(schema, dict)]
    starts += [f"#/{k}/{name}" for k, d in defs if isinstance(d, dict) for name in d]
    done: set[str] = set()
    for start in starts:
        path = [start]
        stack = [iter(links(start))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path.pop())
                continue
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt in done or len(path) > 1000:
                continue
            path.append(nxt)
            stack.append(iter(links(nxt)))
    return None


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.type if isinstance(part, TextPart) else part.get("type")
                if kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported: this model "
                                     "reads text only")
        return v

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required for a {self.role} message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.get("text", "") for p in self.content)


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        if v is not None:
            check_json_schema(v)
        return v


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {value}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# OpenAI fields that mixbit cannot honour: a clear 400, never silently ignored.
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": None,  # allowed when it is ["text"]
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy `functions` field is not supported; send `tools`",
    "function_call": "the legacy `function_call` field is not supported; send `tool_choice`",
    "suffix": "`suffix` (insertion) is not supported",
    "best_of": "`best_of` is not supported; use `n`",
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v):
        if isinstance(v, dict):
            fn = v.get("function")
            name = fn.get("name") if isinstance(fn, dict) else v.get("name")
            if v.get("type", "function") != "function" or not isinstance(name, str) or not name:
                raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": "<a tool\'s name>"}}')
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be one of text, json_object, json_schema; got {kind!r}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("json_schema must be an object with a `schema` (and a `name`)")
            if spec.get("schema") is not None:
                check_json_schema(spec["schema"])
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ValueError("logprobs must be a boolean for chat completions")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class ScoreRequest(BaseModel):
    """mixbit's POST /v1/score: teacher-forced top-k log-probabilities at positions start.."""
    model: str | None = None
    tokens: list[int] = Field(min_length=2)
    start: int = Field(ge=1)
    top_k: int = Field(64, ge=1, le=1024)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _lp(cls, v):
        if v is not None and not isinstance(v, bool) and not 0 <= v <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        return v


# ------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    """OpenAI's id shapes: chatcmpl-..., cmpl-..., call_..."""
    sep = "_" if prefix == "call" else "-"
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mixbit"
    max_model_len: int  # the context in tokens, prompt and generation together (vLLM's field)
    # provenance of what is served (recipe, bits per weight, measured fidelity)
    mixbit: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
