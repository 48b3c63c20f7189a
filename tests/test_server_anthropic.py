"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK: text,
tool use and its result, forced tools, thinking blocks and their budget, stop sequences, the
streamed event sequence, prompt reuse across turns, Anthropic's error shape, and a Claude-Code-
shaped agent loop that runs until the context is full."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .server_proc import ServerProcess

MODEL = "tiny-qwen3.5"
KEY = "sk-test-anthropic"
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
OSLO = [{"role": "user", "content": "What's the weather in Oslo?"}]
JOKE = [{"role": "user", "content": "Tell me a joke."}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("server.request_timeout_s=120", f"server.api_keys=['{KEY}']").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_text_answer(client):
    r = client.messages.create(model=MODEL, max_tokens=64, messages=JOKE, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 64


def test_tool_use_then_its_result_then_the_answer(client):
    r = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=OSLO, temperature=0)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Oslo"} and call.id
    assert not any(b.type == "text" and "<tool_call>" in b.text for b in r.content)
    result = json.dumps({"city": "Oslo", "temperature_c": 12, "condition": "rainy"})
    r2 = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], temperature=0, messages=[
        *OSLO, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": result}]}]}])
    assert r2.stop_reason == "end_turn" and [b.type for b in r2.content] == ["text"]
    assert "12" in r2.content[0].text
    # an agent resends its history: the second turn reads the first one's prompt from the cache
    assert r2.usage.cache_read_input_tokens > 0
    assert r2.usage.input_tokens < r.usage.input_tokens


def test_forced_tool_any_and_named(client):
    r = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=JOKE, temperature=0,
                               tool_choice={"type": "any"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    assert set(r.content[0].input) == {"city"}
    two = [WEATHER, {"name": "get_time", "description": "Current time in a timezone.",
                     "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}},
                                      "required": ["tz"]}}]
    r = client.messages.create(model=MODEL, max_tokens=64, tools=two, messages=OSLO, temperature=0,
                               tool_choice={"type": "tool", "name": "get_time",
                                            "disable_parallel_tool_use": True})
    assert [(b.type, b.name) for b in r.content] == [("tool_use", "get_time")]
    assert set(r.content[0].input) == {"tz"}
    r = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=OSLO, temperature=0,
                               tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "end_turn"


def test_thinking_blocks_and_their_budget(client):
    def think(budget):
        r = client.messages.create(model=MODEL, max_tokens=300, messages=JOKE, temperature=0,
                                   thinking={"type": "enabled", "budget_tokens": budget})
        assert [b.type for b in r.content] == ["thinking", "text"], r.content
        assert r.content[1].text.strip() and r.stop_reason == "end_turn"
        return r.content[0].thinking
    free, capped = think(200), think(2)
    # past the budget the server closes the thinking itself and the model answers
    assert len(capped) < len(free)
    n = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": capped}]).input_tokens
    m = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": ""}]).input_tokens
    assert n - m <= 2
    # thinking blocks sent back in the history are read, not rejected
    r = client.messages.create(model=MODEL, max_tokens=32, temperature=0, messages=[
        *JOKE, {"role": "assistant", "content": [{"type": "thinking", "thinking": free, "signature": ""},
                                                 {"type": "text", "text": "Why not?"}]},
        {"role": "user", "content": "Another one."}])
    assert r.content


def test_stop_sequence_and_max_tokens(client):
    plain = client.messages.create(model=MODEL, max_tokens=64, messages=JOKE, temperature=0).content[0].text
    word = plain.split()[3]
    r = client.messages.create(model=MODEL, max_tokens=64, messages=JOKE, temperature=0,
                               stop_sequences=["zzz-never", word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text.rstrip() == plain[:plain.index(word)].rstrip()
    r = client.messages.create(model=MODEL, max_tokens=3, messages=JOKE, temperature=0)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    # a client's own output limit (Claude Code sends 32000) is a cap, not an error
    r = client.messages.create(model=MODEL, max_tokens=16000, messages=JOKE, temperature=0)
    assert r.stop_reason == "end_turn"


@pytest.mark.parametrize("thinking", [False, True])
def test_stream_events_in_order_and_equal_to_the_message(client, thinking):
    kwargs = dict(model=MODEL, max_tokens=120, tools=[WEATHER], messages=OSLO, temperature=0)
    if thinking:
        kwargs["thinking"] = {"type": "enabled", "budget_tokens": 60}
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == [b.type for b in plain.content]
    # every block opens, takes its deltas and closes before the next one opens
    open_index = None
    for e in events:
        if e.type == "content_block_start":
            assert open_index is None
            open_index = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_index
        elif e.type == "content_block_stop":
            assert e.index == open_index
            open_index = None
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert "input_json_delta" in deltas and (("thinking_delta" in deltas) == thinking)
    strip = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]  # noqa: E731
    assert strip(final.content) == strip(plain.content)
    assert final.stop_reason == plain.stop_reason == "tool_use"
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_sends_ping_and_anthropic_event_names(server):
    with httpx.stream("POST", server.url + "/v1/messages", json={
            "model": MODEL, "max_tokens": 16, "stream": True, "messages": JOKE, "temperature": 0},
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names


def test_count_tokens_matches_the_prompt_the_model_reads(client):
    kwargs = dict(model=MODEL, messages=OSLO, tools=[WEATHER], system="You are terse.")
    counted = client.messages.count_tokens(**kwargs).input_tokens
    fresh = client.messages.create(max_tokens=1, temperature=0, **{**kwargs, "system": "You are terse!"})
    assert counted > 0 and abs(counted - fresh.usage.input_tokens - fresh.usage.cache_read_input_tokens) <= 2


def test_errors_have_anthropics_shape(server, client):
    def fails(status, kind, **body):
        r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": JOKE,
                                                          **body}, headers={"x-api-key": KEY})
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        return r.json()["error"]["message"]
    assert "max_tokens" in fails(400, "invalid_request_error", max_tokens=None)
    assert "image" in fails(400, "invalid_request_error", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "messages[0].content[1].text" in fails(400, "invalid_request_error", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": 5}]}])
    assert "budget_tokens" in fails(400, "invalid_request_error",
                                    thinking={"type": "enabled", "budget_tokens": 8})
    assert "tool_choice" in fails(400, "invalid_request_error", tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "nope"})
    assert "not a field" in fails(400, "invalid_request_error", frobnicate=True)
    assert "temperature" in fails(400, "invalid_request_error", temperature=1.5)
    assert "does not exist" in fails(404, "not_found_error", model="claude-sonnet-4-5")
    assert "prompt is too long" in fails(400, "invalid_request_error",
                                         messages=[{"role": "user", "content": "word " * 5000}])
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=JOKE)
    assert err.value.body["error"]["type"] == "authentication_error"
    # Claude Code can send the key as a bearer token (ANTHROPIC_AUTH_TOKEN)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=4, messages=JOKE).content
    r = httpx.post(server.url + "/v1/messages", content=b'{"model": ', headers={
        "x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages/batches", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.messages.create(model=MODEL, max_tokens=8, messages=JOKE).content  # still serving


SYSTEM = ("You are a coding agent working in a repository. Use the tools to inspect and change "
          "files; run commands with bash. Keep answers short. ") + " ".join(
    f"Rule {i}: prefer small, reviewed changes; read a file before you edit it; run the tests "
    f"after each change." for i in range(15))
CODE_TOOLS = [
    {"name": "bash", "description": "Run a shell command and return its output.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "read_file", "description": "Read a file and return its text.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "write_file", "description": "Write text to a file, replacing it.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                      "required": ["path", "content"]}},
    {"name": "edit_file", "description": "Replace old text with new text in a file.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                       "new": {"type": "string"}},
                      "required": ["path", "old", "new"]}},
]
TASKS = ["Read the file README.md.", "Run the tests with bash.", "Write hello.py that prints hello.",
         "In hello.py replace hello with goodbye.", "List the files with bash.", "Read the file hello.py."]


def _run_tool(root, name: str, args: dict) -> tuple[str, bool]:
    """The client side of the loop: file tools on a scratch folder; bash is not executed (the
    model's commands are not ours to run) and answers as a shell would for these tasks."""
    path = root / str(args.get("path", "x")).lstrip("/").replace("..", "_")
    try:
        if name == "read_file":
            return path.read_text(), False
        if name == "write_file":
            path.write_text(str(args["content"]))
            return f"wrote {len(str(args['content']))} bytes to {path.name}", False
        if name == "edit_file":
            text = path.read_text()
            if str(args["old"]) not in text:
                return f"{args['old']!r} not found in {path.name}", True
            path.write_text(text.replace(str(args["old"]), str(args["new"]), 1))
            return f"edited {path.name}", False
        if name == "bash":
            return "README.md\nhello.py\n2 passed in 0.01s", False
    except (OSError, KeyError) as exc:
        return str(exc), True
    return f"unknown tool {name}", True


def test_claude_code_shaped_loop_until_the_context_is_full(server, client, tmp_path):
    (tmp_path / "README.md").write_text("# demo\nA demo project.\n")
    history: list[dict] = []
    rounds = calls = cached_turns = 0
    full = None
    for turn in range(200):
        if not history or history[-1]["role"] == "assistant":
            history.append({"role": "user", "content": TASKS[turn % len(TASKS)]})
        try:
            r = client.messages.create(model=MODEL, max_tokens=256, system=SYSTEM, tools=CODE_TOOLS,
                                       messages=history, temperature=0)
        except anthropic.BadRequestError as exc:
            full = exc
            break
        rounds += 1
        cached_turns += r.usage.cache_read_input_tokens > 0
        assert not any(b.type == "text" and ("<tool_call>" in b.text or "<function=" in b.text)
                       for b in r.content), r.content
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        uses = [b for b in r.content if b.type == "tool_use"]
        assert (r.stop_reason == "tool_use") == bool(uses)
        if uses:
            calls += len(uses)
            results = []
            for b in uses:
                assert isinstance(b.input, dict)
                out, failed = _run_tool(tmp_path, b.name, b.input)
                results.append({"type": "tool_result", "tool_use_id": b.id, "content": out, "is_error": failed})
            history.append({"role": "user", "content": results})
    assert full is not None, "the context never filled"
    assert full.body["error"]["message"].startswith("prompt is too long")
    assert rounds >= 10 and calls >= rounds // 2, (rounds, calls)
    # every turn after the first reuses the history's prefix, a new user message included (the
    # template drops the earlier turns' thinking there: the engine keeps a state before it)
    assert cached_turns == rounds - 1
    # a new conversation with the same system prompt and tools starts from the stored system block
    system_only = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=CODE_TOOLS,
                                               messages=[{"role": "user", "content": ""}]).input_tokens
    other = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, tools=CODE_TOOLS,
                                   messages=[{"role": "user", "content": "Something else entirely."}])
    assert system_only - 16 <= other.usage.cache_read_input_tokens < system_only
    # the full context is the client's problem, not the server's
    assert client.messages.create(model=MODEL, max_tokens=8, messages=JOKE).content
    metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).text
    assert 'endpoint="/v1/messages"' in metrics


def test_agent_soak_plays_through_this_api(server):
    """`mixbit eval --variants ... --soak` serves each variant and runs its agent loop through
    /v1/messages (quant/soak.py); the context it stops at comes from GET /v1/models."""
    from mixbit.quant.soak import messages_soak

    card = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]
    assert card["max_model_len"] == 4096  # vLLM's field: prompt and generation together
    r = messages_soak(server.url, max_rounds=3, api_key=KEY)
    assert (r.rounds, r.broke_at, r.reason, r.played, r.failed) == (3, None, "", 3, 0), r
    assert r.right_calls >= 2 and 500 < r.tokens < 4096, r


def test_anthropic_defined_client_tools_get_their_schemas(client):
    """bash_20250124 and text_editor_* carry no input_schema (Anthropic's API knows it): mixbit
    fills in the schema their clients send inputs in, so a forced call has the right shape."""
    ask = [{"role": "user", "content": "List the files in /tmp, then show me /tmp/notes.txt."}]
    r = client.messages.create(model=MODEL, max_tokens=64, messages=ask, temperature=0,
                               tools=[{"type": "bash_20250124", "name": "bash"}],
                               tool_choice={"type": "tool", "name": "bash"})
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "bash" and set(call.input) <= {"command", "restart"} and call.input, call.input
    assert isinstance(call.input.get("command", ""), str) and isinstance(call.input.get("restart", False), bool)
    r = client.messages.create(model=MODEL, max_tokens=96, messages=ask, temperature=0,
                               tools=[{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}],
                               tool_choice={"type": "any"})
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "str_replace_based_edit_tool"
    assert call.input["command"] in ("view", "create", "str_replace", "insert") and isinstance(call.input["path"], str)
    with pytest.raises(anthropic.BadRequestError) as err:  # its name is fixed
        client.messages.create(model=MODEL, max_tokens=8, messages=ask,
                               tools=[{"type": "bash_20250124", "name": "shell"}])
    assert "'bash'" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:  # a server tool runs on Anthropic's side
        client.messages.create(model=MODEL, max_tokens=8, messages=ask,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "web_search_20250305" in err.value.body["error"]["message"]
