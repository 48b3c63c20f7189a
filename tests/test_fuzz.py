"""Fuzzing the HTTP API of the real server process.

1. A barrage of malformed requests (huge integers, invalid Unicode, deep nesting, huge arrays and
   maps, recursive and invalid JSON Schemas, wrong types in every top-level field, tool_choice
   naming a tool that is not offered, oversized bodies) over /v1/chat/completions,
   /v1/completions and /v1/responses. Each must be answered with a 4xx in OpenAI's error shape,
   and the server must go on answering a normal request on the same keep-alive connection.
2. schemathesis: requests generated from the server's own /openapi.json; no operation may
   answer with a server error (5xx).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .server_proc import ServerProcess
from .test_server_api import MODEL, ask

S = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\ud800", kept as-is on the wire
LOW = "\udc00"
DEEP = "@@DEEP@@"  # placeholder replaced by a deeply nested JSON text
NEST = 10_000
BIG = 100_000
MAX_BODY = 8_000_000

CHAT_OK = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 2, "temperature": 0}
CMPL_OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
RESP_OK = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0}
CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSGS, COUNT = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's shapes
BASES = {CHAT: CHAT_OK, CMPL: CMPL_OK, RESP: RESP_OK}
ENDPOINT_TAG = {CHAT: "chat", CMPL: "cmpl", RESP: "resp"}
DROP = object()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# --------------------------------------------------------------------------------- the server
class Live:
    """The module's server and one httpx.Client (one keep-alive connection) to it; restarted
    before a case when an earlier case killed it, so one crash does not fail every later case."""

    def __init__(self, *settings: str):
        self.settings = settings
        self.restarts = 0  # test_no_case_broke_the_server (last in this file) requires 0
        self._start()

    def _start(self):
        self.server = ServerProcess(*self.settings).wait_ready()
        self.client = httpx.Client(base_url=self.server.url, timeout=120)

    def ensure(self):
        """Restarts the server unless it is alive and generates (/health alone can say ok while
        every generation fails)."""
        try:
            healthy = (self.server.proc.poll() is None
                       and self.client.get("/health", timeout=10).status_code == 200
                       and self.client.post(CHAT, json=CHAT_OK, timeout=30).status_code == 200)
        except httpx.HTTPError:
            healthy = False
        if not healthy:
            self.restarts += 1
            self.close()
            self._start()

    def close(self):
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def live():
    lv = Live(f"server.max_body_bytes={MAX_BODY}", "server.request_timeout_s=30")
    yield lv
    lv.close()


def local_port(r: httpx.Response):
    return r.extensions["network_stream"].get_extra_info("client_addr")


def assert_openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def param_matches(got: str | None, want: str, prefix: bool) -> bool:
    if got == want:
        return True
    return prefix and isinstance(got, str) and (got.startswith(want + ".") or got.startswith(want + "["))


# --------------------------------------------------------------------------------- the cases
@dataclass
class Bad:
    id: str
    path: str
    body: bytes | Callable[[], bytes | Any]  # bytes, or a function building them (or an iterator)
    status: tuple = (400,)
    param: str | None = None  # the error's param must be this field...
    prefix: bool = False  # ...or a path inside it (messages[0].content[0].text for messages[0].content)
    code: str | None = None


def dump(obj, deep: str | None = None) -> bytes:
    text = json.dumps(obj)  # ensure_ascii: lone surrogates stay "\ud800" escapes
    if deep is not None:
        text = text.replace(json.dumps(DEEP), deep)
    return text.encode()


def over(path: str, **fields) -> dict:
    body = {**BASES[path]}
    for k, v in fields.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def chat(**fields) -> bytes:
    return dump(over(CHAT, **fields))


def cmpl(**fields) -> bytes:
    return dump(over(CMPL, **fields))


def resp(**fields) -> bytes:
    return dump(over(RESP, **fields))


def tool(parameters=None, name="get_weather", description="Weather in a city", strict=None) -> dict:
    fn = {"name": name, "description": description, "parameters": WEATHER if parameters is None else parameters}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def resp_tool(parameters=None, name="get_weather", description="Weather in a city") -> dict:
    return {"type": "function", "name": name, "description": description,
            "parameters": WEATHER if parameters is None else parameters}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def raw_with(path: str, field_name: str, raw_value: str) -> bytes:
    """The base body with one field's value written as raw JSON text (1e400, NaN...)."""
    return dump(over(path, **{field_name: DEEP}), deep=raw_value)


def deep_arrays(n=NEST) -> str:
    return "[" * n + "]" * n


def deep_objects(n=NEST) -> str:
    return '{"a": ' * n + "1" + "}" * n


REF_ROOT = {"$ref": "#"}
REF_DEFS = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
INVALID_SCHEMAS = {"type-bogus": {"type": "bogus"}, "type-5": {"type": 5}, "properties-3": {"properties": 3}}

HUGE_INTS = [
    Bad("chat-seed-2**80", CHAT, chat(seed=2**80), param="seed"),
    Bad("chat-seed-2**64", CHAT, chat(seed=2**64), param="seed"),
    Bad("chat-seed-below-int64", CHAT, chat(seed=-(2**63) - 1), param="seed"),
    Bad("chat-max_tokens-1e30", CHAT, chat(max_tokens=10**30), param="max_tokens"),
    Bad("chat-max_completion_tokens-2**63", CHAT, chat(max_tokens=DROP, max_completion_tokens=2**63),
        param="max_completion_tokens"),
    Bad("chat-n-1e20", CHAT, chat(n=10**20), param="n"),
    Bad("chat-n-minus-2**70", CHAT, chat(n=-(2**70)), param="n"),
    Bad("chat-top_logprobs-1e30", CHAT, chat(logprobs=True, top_logprobs=10**30), param="top_logprobs"),
    Bad("chat-logit_bias-value-1e308", CHAT, chat(logit_bias={"100": 1e308}), param="logit_bias", prefix=True),
    Bad("chat-logit_bias-key-2**80", CHAT, chat(logit_bias={str(2**80): 1}), param="logit_bias", prefix=True),
    Bad("chat-temperature-1e400-raw", CHAT, raw_with(CHAT, "temperature", "1e400")),
    Bad("chat-top_p-NaN-raw", CHAT, raw_with(CHAT, "top_p", "NaN")),
    Bad("chat-presence_penalty-minus-1e400-raw", CHAT, raw_with(CHAT, "presence_penalty", "-1e400")),
    Bad("cmpl-max_tokens-1e30", CMPL, cmpl(max_tokens=10**30), param="max_tokens"),
    Bad("cmpl-logprobs-1e30", CMPL, cmpl(logprobs=10**30), param="logprobs"),
    Bad("cmpl-prompt-token-2**70", CMPL, cmpl(prompt=[1, 2**70]), param="prompt", prefix=True),
    Bad("cmpl-seed-2**80", CMPL, cmpl(seed=2**80), param="seed"),
    Bad("resp-max_output_tokens-1e30", RESP, resp(max_output_tokens=10**30), param="max_output_tokens"),
    Bad("resp-seed-2**80", RESP, resp(seed=2**80), param="seed"),
    Bad("resp-top_logprobs-1e30", RESP, resp(top_logprobs=10**30), param="top_logprobs"),
]

ASSISTANT_CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": "Par" + S})}}]}
UNICODE = [
    Bad("chat-surrogate-content", CHAT, chat(messages=ask("Hi " + S)), param="messages[0].content"),
    Bad("chat-surrogate-content-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": S}]}]), param="messages[0].content", prefix=True),
    Bad("chat-low-surrogate-second-message", CHAT, chat(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": LOW + "x"}]),
        param="messages[1].content"),
    Bad("chat-reversed-pair-content", CHAT, chat(messages=ask(LOW + S)), param="messages[0].content"),
    Bad("chat-surrogate-tool-name", CHAT, chat(tools=[tool(name="f" + S)]), param="tools[0].function.name"),
    Bad("chat-surrogate-tool-description", CHAT, chat(tools=[tool(description="Weather " + S)]),
        param="tools[0].function.description"),
    Bad("chat-surrogate-tool-parameters", CHAT, chat(tools=[tool({"type": "object", "properties": {
        "city": {"type": "string", "description": S}}})]), param="tools[0].function.parameters", prefix=True),
    Bad("chat-surrogate-stop-string", CHAT, chat(stop=S), param="stop"),
    Bad("chat-surrogate-stop-list", CHAT, chat(stop=["ok", "x" + S]), param="stop", prefix=True),
    Bad("chat-surrogate-response_format-schema", CHAT, chat(response_format=schema_format(
        {"type": "object", "properties": {"a" + S: {"type": "string"}}})), param="response_format", prefix=True),
    Bad("chat-surrogate-tool_call-arguments", CHAT, chat(messages=ask("Weather?") + [ASSISTANT_CALL]),
        param="messages[1].tool_calls[0]", prefix=True),
    Bad("chat-surrogate-user", CHAT, chat(user=S), param="user"),
    Bad("chat-surrogate-model", CHAT, chat(model=MODEL + S), status=(400, 404), param="model"),
    Bad("chat-surrogate-logit_bias-key", CHAT, chat(logit_bias={S: 1}), param="logit_bias", prefix=True),
    Bad("cmpl-surrogate-prompt", CMPL, cmpl(prompt="Hi " + S), param="prompt"),
    Bad("cmpl-surrogate-prompt-list", CMPL, cmpl(prompt=["Hi", S]), param="prompt", prefix=True),
    Bad("cmpl-surrogate-stop", CMPL, cmpl(stop=[S]), param="stop", prefix=True),
    Bad("resp-surrogate-input", RESP, resp(input="Hi " + S), param="input"),
    Bad("resp-surrogate-input-item", RESP, resp(input=[{"role": "user", "content": [
        {"type": "input_text", "text": S}]}]), param="input[0]", prefix=True),
    Bad("resp-surrogate-instructions", RESP, resp(instructions="Be brief " + S), param="instructions"),
    Bad("resp-surrogate-tool-description", RESP, resp(tools=[resp_tool(description=S)]), param="tools[0]",
        prefix=True),
    # not escapes: UTF-8 bytes that do not decode (an encoded surrogate, a stray 0xff)
    Bad("chat-utf8-encoded-surrogate-bytes", CHAT, chat(messages=ask("@@X@@")).replace(b"@@X@@", b"\xed\xa0\x80")),
    Bad("chat-invalid-utf8-byte", CHAT, chat(messages=ask("@@X@@")).replace(b"@@X@@", b"\xff")),
]

NESTING = [
    Bad("chat-deep-arrays-in-content", CHAT, lambda: dump(over(CHAT, messages=[
        {"role": "user", "content": DEEP}]), deep_arrays())),
    Bad("chat-deep-objects-in-response_format", CHAT, lambda: raw_with(CHAT, "response_format", deep_objects())),
    Bad("chat-deep-objects-in-tool-parameters", CHAT, lambda: dump(over(CHAT, tools=[tool(DEEP)]), deep_objects())),
    Bad("chat-deep-objects-in-chat_template_kwargs", CHAT,
        lambda: raw_with(CHAT, "chat_template_kwargs", '{"x": ' + deep_objects() + "}")),
    Bad("cmpl-deep-arrays-in-prompt", CMPL, lambda: raw_with(CMPL, "prompt", deep_arrays())),
    Bad("resp-deep-objects-in-metadata", RESP, lambda: raw_with(RESP, "metadata", deep_objects())),
    Bad("resp-deep-arrays-in-input", RESP, lambda: raw_with(RESP, "input", deep_arrays())),
]

HUGE = [
    Bad("chat-100k-messages", CHAT, lambda: chat(messages=[{"role": "user", "content": "x"}] * BIG),
        param="messages"),
    Bad("chat-100k-stop-strings", CHAT, lambda: chat(stop=[f"s{i}" for i in range(BIG)]), param="stop"),
    Bad("chat-logit_bias-100k-keys", CHAT,
        lambda: chat(logit_bias={**{str(i): 1 for i in range(BIG)}, "not-a-token": 1}), param="logit_bias",
        prefix=True),
    Bad("cmpl-100k-token-prompt", CMPL, lambda: cmpl(prompt=[1] * BIG), param="prompt"),
    Bad("resp-100k-input-items", RESP, lambda: resp(input=[{"role": "user", "content": "x"}] * BIG),
        param="input"),
]

SCHEMAS = [
    Bad("chat-response_format-ref-root", CHAT, chat(response_format=schema_format(REF_ROOT)),
        param="response_format", prefix=True),
    Bad("chat-response_format-defs-self-ref", CHAT, chat(response_format=schema_format(REF_DEFS)),
        param="response_format", prefix=True),
    Bad("chat-tool-ref-root", CHAT, chat(tools=[tool(REF_ROOT, strict=True)], tool_choice="required"),
        param="tools", prefix=True),
    Bad("chat-tool-defs-self-ref", CHAT, chat(tools=[tool(REF_DEFS, strict=True)], tool_choice="required"),
        param="tools", prefix=True),
    Bad("resp-text-format-ref-root", RESP, resp(text={"format": {"type": "json_schema", "name": "out",
                                                                 "schema": REF_ROOT, "strict": True}})),
    *[Bad(f"chat-response_format-{k}", CHAT, chat(response_format=schema_format(s)),
          param="response_format", prefix=True) for k, s in INVALID_SCHEMAS.items()],
    *[Bad(f"chat-tool-parameters-{k}", CHAT, chat(tools=[tool(s)]),
          param="tools[0].function.parameters", prefix=True) for k, s in INVALID_SCHEMAS.items()],
    Bad("chat-second-tool-parameters-type-bogus", CHAT, chat(tools=[tool(), tool({"type": "bogus"}, name="other")]),
        param="tools[1].function.parameters", prefix=True),
    Bad("chat-strict-tool-parameters-properties-3", CHAT, chat(tools=[tool({"properties": 3}, strict=True)],
                                                                tool_choice="required"),
        param="tools[0].function.parameters", prefix=True),
    Bad("chat-response_format-schema-not-object", CHAT, chat(response_format=schema_format("string")),
        param="response_format", prefix=True),
    Bad("chat-response_format-unknown-type", CHAT, chat(response_format={"type": "yaml"}),
        param="response_format", prefix=True),
    Bad("resp-text-format-type-bogus", RESP, resp(text={"format": {"type": "json_schema", "name": "out",
                                                                   "schema": {"type": "bogus"}}}),
        param="text", prefix=True),
    Bad("resp-tool-parameters-properties-3", RESP, resp(tools=[resp_tool({"properties": 3})]),
        param="tools[0].parameters", prefix=True),
]

TOOL_CHOICE = [
    Bad("chat-tool_choice-names-unoffered-tool", CHAT, chat(tools=[tool()], tool_choice={
        "type": "function", "function": {"name": "launch_missiles"}}), param="tool_choice", prefix=True),
    Bad("chat-tool_choice-named-without-tools", CHAT, chat(tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), param="tool_choice", prefix=True),
    Bad("chat-tool_choice-required-without-tools", CHAT, chat(tool_choice="required"), param="tool_choice"),
    Bad("resp-tool_choice-names-unoffered-tool", RESP, resp(tools=[resp_tool()], tool_choice={
        "type": "function", "name": "launch_missiles"}), param="tool_choice", prefix=True),
]

# a wrong type in every top-level field: the error names that field
WRONG_TYPES = {
    CHAT: {"model": 5, "messages": "x", "max_tokens": "five", "max_completion_tokens": "x",
           "temperature": "hot", "top_p": {}, "top_k": "x", "min_p": [], "seed": "abc", "stop": 5,
           "n": "two", "stream": "maybe", "stream_options": "x", "logprobs": "x",
           "top_logprobs": "x", "presence_penalty": "x", "frequency_penalty": [],
           "repetition_penalty": {}, "logit_bias": [], "user": {}, "tools": {}, "tool_choice": 5,
           "parallel_tool_calls": "x", "response_format": "json", "chat_template_kwargs": [],
           "reasoning_effort": 5},
    CMPL: {"model": [MODEL], "prompt": 5, "echo": "x", "logprobs": "x", "stop": {},
           "max_tokens": "x", "seed": 1.5, "n": [], "stream": {}, "user": 5},
    RESP: {"input": 5, "instructions": 5, "tools": "x", "tool_choice": 5, "parallel_tool_calls": "x",
           "text": "x", "reasoning": "x", "max_output_tokens": "x", "temperature": "x", "top_p": [],
           "top_logprobs": {}, "stream": "x", "store": "x", "previous_response_id": 5,
           "metadata": "x", "user": 5, "seed": "x", "background": "x"},
}
REQUIRED = {CHAT: ["model", "messages"], CMPL: ["model", "prompt"], RESP: ["model", "input"]}
TYPES = [
    *[Bad(f"{ENDPOINT_TAG[p]}-wrong-type-{k}", p, dump(over(p, **{k: v})), param=k)
      for p, fields in WRONG_TYPES.items() for k, v in fields.items()],
    *[Bad(f"{ENDPOINT_TAG[p]}-null-{k}", p, dump(over(p, **{k: None})), param=k)
      for p, keys in REQUIRED.items() for k in keys],
    *[Bad(f"{ENDPOINT_TAG[p]}-body-{name}", p, text)
      for p in (CHAT, CMPL, RESP)
      for name, text in (("array", b"[]"), ("null", b"null"), ("string", b'"hi"'), ("empty-object", b"{}"))],
]


def _oversized_chunks():
    yield b'{"model": "tiny-qwen3.5", "prompt": "'
    for _ in range(MAX_BODY // 100_000 + 10):
        yield b"x" * 100_000
    yield b'"}'


OVERSIZED = [
    Bad("chat-oversized-body", CHAT, lambda: chat(messages=ask("x" * (MAX_BODY + 1000))), status=(413,),
        code="request_too_large"),
    Bad("cmpl-oversized-chunked-body", CMPL, _oversized_chunks, status=(413,), code="request_too_large"),
    Bad("resp-oversized-body", RESP, lambda: resp(input="x" * (MAX_BODY + 1000)), status=(413,),
        code="request_too_large"),
]

BARRAGE = HUGE_INTS + UNICODE + NESTING + HUGE + SCHEMAS + TOOL_CHOICE + TYPES + OVERSIZED
assert len({c.id for c in BARRAGE}) == len(BARRAGE)


@pytest.mark.parametrize("case", BARRAGE, ids=[c.id for c in BARRAGE])
def test_malformed_request_is_a_4xx_and_the_server_keeps_serving(live, case: Bad):
    live.ensure()
    c = live.client
    body = case.body() if callable(case.body) else case.body
    r = c.post(case.path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code in case.status, f"{r.status_code}: {r.text[:800]}"
    port = local_port(r)
    err = assert_openai_error(r)
    if case.param is not None:
        assert param_matches(err["param"], case.param, case.prefix), err
    if case.code is not None:
        assert err["code"] == case.code, err
    # the same client, and (413 aside: a server may close after a body it did not read) the same
    # keep-alive connection, still gets a normal answer
    after = c.post(CHAT, json=CHAT_OK)
    assert after.status_code == 200, after.text[:800]
    if 413 not in case.status:
        assert local_port(after) == port, "the server closed the connection after the error"
    assert c.get("/health").json() == {"status": "ok"}


def test_seed_range(live):
    """Seeds in [-2**63, 2**64-1] work (the whole unsigned and signed 64-bit ranges); outside: 400."""
    live.ensure()
    c = live.client
    for seed in (2**64 - 1, -1, -(2**63), 0):
        r = c.post(CHAT, json={**CHAT_OK, "seed": seed, "temperature": 1.0})
        assert r.status_code == 200, (seed, r.text[:800])
    r = c.post(CMPL, json={**CMPL_OK, "seed": 2**64 - 1})
    assert r.status_code == 200, r.text[:800]
    r = c.post(CHAT, json={**CHAT_OK, "seed": 2**80})
    assert r.status_code == 400, r.text[:800]
    assert assert_openai_error(r)["param"] == "seed"
    for _ in range(3):  # the engine survived it
        assert c.post(CHAT, json=CHAT_OK).status_code == 200
    assert c.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_top_k_beyond_the_vocabulary(live, path):
    """top_k of the vocabulary size or more (the schema allows any top_k >= 0): served (top_k
    means all tokens) or a 400 naming top_k, never a 5xx, and the engine keeps generating."""
    live.ensure()
    c = live.client
    for top_k in (4096, 5000, 10**6, 2**63, 10**40):
        r = c.post(path, json={**BASES[path], "top_k": top_k, "temperature": 1.0})
        assert r.status_code in (200, 400), (top_k, r.text[:800])
        if r.status_code == 400:
            assert assert_openai_error(r)["param"] == "top_k"
        after = c.post(CHAT, json=CHAT_OK)
        assert after.status_code == 200, (top_k, after.text[:800])


# ------------------------------------------------------------------------------- schemathesis
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2}


@pytest.fixture(scope="module")
def fuzz_live():
    # generation.max_tokens: a request without max_tokens generates at most 4 tokens too
    lv = Live("server.request_timeout_s=20", "generation.max_tokens=4")
    yield lv
    lv.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_live):
    config = schemathesis.Config.from_dict({
        "seed": 1234,  # reproducible runs (with derandomize below)
        "generation": {"deterministic": True, "database": "none"},
        "request-timeout": 60,
        # the failure report's curl shows every field (max_tokens is "sensitive" by default)
        "output": {"sanitization": {"enabled": False}},
    })
    return schemathesis.openapi.from_url(fuzz_live.server.url + "/openapi.json", config=config)


RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "reasoning", "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream",
                    "store", "metadata", "user", "seed"}


def tame(case) -> None:
    """Lets generation run. A body mostly names the served model and always gets tiny token
    budgets; half of the chat and responses bodies also get one plain user message (the schema
    allows messages the server rightly rejects: a user message without content, a part without a
    type) and lose what can only be rejected (logit_bias keys that are no token ids, Responses
    fields OpenAI does not define, previous_response_id). The rest stays as generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    digest = zlib.crc32(json.dumps(body, sort_keys=True, default=repr).encode())
    if digest % 8:  # 7 of 8 bodies name the served model; the rest keep a random one
        body["model"] = MODEL
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if (digest >> 3) % 2:
        return
    path = case.operation.path
    if path == CHAT:
        body["messages"] = ask("Hi")
    elif path == RESP:
        for key in set(body) - RESPONSES_FIELDS:
            del body[key]
    elif path in (MSGS, COUNT):
        body["messages"] = ask("Hi")
        body.pop("thinking", None)
    elif path == CMPL and isinstance(body.get("prompt"), list):
        body["prompt"] = in_vocab(body["prompt"]) or "Hi"
    elif path == "/v1/score" and isinstance(body.get("tokens"), list) and len(body["tokens"]) >= 2:
        body["tokens"] = in_vocab(body["tokens"])
        if isinstance(body.get("start"), int):
            body["start"] = 1 + body["start"] % (len(body["tokens"]) - 1)
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {k: v for k, v in body["logit_bias"].items() if k.isdigit()}


def in_vocab(value):
    """Token ids (in lists, nested lists) folded into [0, 1000), inside any model's vocabulary."""
    if isinstance(value, list):
        return [in_vocab(v) for v in value]
    return value % 1000 if isinstance(value, int) and not isinstance(value, bool) else value


# Every operation of /openapi.json (test_operations_are_all_fuzzed keeps the list complete).
# Parametrized here rather than with schemathesis.pytest.from_fixture: its lazy loader reads
# pytest's private Function._nodeid, which pytest 9.2 does not have (AttributeError).
OPERATIONS = [("GET", "/health"), ("GET", "/ready"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
              ("GET", "/v1/fidelity"), ("POST", "/v1/score"), ("POST", "/v1/responses"),
              ("POST", "/v1/completions"), ("POST", MSGS), ("POST", COUNT)]
# negative (schema-violating) data needs something to violate: a body or a query parameter
NEGATIVE = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
            ("POST", "/v1/score"), ("GET", "/v1/fidelity"), ("POST", MSGS), ("POST", COUNT)}
RUNS = [(m, p, "positive") for m, p in OPERATIONS] + [(m, p, "negative") for m, p in OPERATIONS
                                                      if (m, p) in NEGATIVE]
EXAMPLES = {"positive": 40, "negative": 40}


def test_operations_are_all_fuzzed(api_schema):
    found = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("method, path, mode", RUNS, ids=[f"{m} {p} {mode}" for m, p, mode in RUNS])
def test_schemathesis_no_server_errors(fuzz_live, api_schema, method, path, mode):
    """Each operation on a server that generates (restarted if an earlier operation broke it, so
    a failure is charged to the operation that caused it)."""
    fuzz_live.ensure()
    base_url = fuzz_live.server.url
    operation = api_schema[path][method]
    generation_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE

    @given(case=operation.as_strategy(generation_mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def fuzz(case):  # no shrinking: a request that breaks the engine makes every later one fail
        tame(case)
        response = case.call(base_url=base_url, timeout=60)
        # every 5xx fails, 503 included: the server is ready, nothing here is overload or shutdown
        case.validate_response(response, checks=[not_a_server_error])
        if 400 <= response.status_code < 500 and path.startswith("/v1/messages"):
            body = response.json()  # Anthropic's error shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and \
                body["error"]["message"], response.text[:800]
        elif 400 <= response.status_code < 500 and path.startswith("/v1/"):
            err = response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:800]

    fuzz()


def test_no_case_broke_the_server(live, fuzz_live):
    """Runs last: a server that had to be restarted between cases was broken by the case before
    (which may have passed its own checks), so the whole run fails."""
    live.ensure()
    fuzz_live.ensure()
    assert (live.restarts, fuzz_live.restarts) == (0, 0)
