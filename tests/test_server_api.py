"""End to end: the real server process, driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from .conftest import WEATHER
from .server_proc import ServerProcess, metric_value

MODEL = "tiny-qwen3.5"
TOOLS = WEATHER


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("server.request_timeout_s=120").wait_ready()
    yield s
    # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is a clean exit too
    assert s.stop() in (0, -15)
    assert "Application shutdown complete" in s.log_path.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def no_eos_bias():
    """logit_bias that forbids the end-of-turn tokens: a generation that runs to max_tokens."""
    from tokenizers import Tokenizer

    from .conftest import EMBEDDED

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    return {str(tok.token_to_id(t)): -100 for t in ("<|im_end|>", "<|endoftext|>")}


def ask(content):
    return [{"role": "user", "content": content}]


def test_models_list_and_get(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]  # the served id, never a path
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["mixbit"]["recipe"] and raw["mixbit"]["model_type"] == "qwen3_5"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_chat_plain_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Hi, I am Anna."), temperature=0,
                                       max_tokens=30)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and "<think>" not in choice.message.content
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-")


def test_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=ask("What day comes after Monday?"), temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**kwargs)
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: prefix reused


def test_next_turn_reuses_the_conversation_so_far(client):
    """Qwen3.5's template renders an answered turn without its (empty) thinking block, so the
    next turn's prompt departs from the last one inside it: the engine keeps the state from
    before the thinking tail, and the next turn prefills only what is new."""
    system = {"role": "system", "content": "You are a helpful assistant. " * 30}
    first = [system, *ask("What day comes after Monday?")]
    r1 = client.chat.completions.create(model=MODEL, messages=first, temperature=0, max_tokens=20)
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              *ask("And after Tuesday?")]
    r2 = client.chat.completions.create(model=MODEL, messages=second, temperature=0, max_tokens=20)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 12
    # another conversation with the same system prompt starts from its stored state
    r3 = client.chat.completions.create(model=MODEL, messages=[system, *ask("Name a colour.")],
                                        temperature=0, max_tokens=5)
    assert r3.usage.prompt_tokens_details.cached_tokens >= r3.usage.prompt_tokens - 25


def test_tool_call_stream_and_non_stream_agree(client):
    kwargs = dict(model=MODEL, messages=ask("What's the weather in Oslo?"), tools=TOOLS, temperature=0,
                  max_tokens=60)
    whole = client.chat.completions.create(**kwargs)
    msg = whole.choices[0].message
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    smsg = final.choices[0].message
    assert (smsg.content or "") == (msg.content or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in smsg.tool_calls or []] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    if msg.tool_calls:
        assert whole.choices[0].finish_reason == "tool_calls"
        assert all(c.id.startswith("call_") for c in msg.tool_calls)
        assert "<tool_call>" not in (msg.content or "")


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is")
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    batch = client.completions.create(model=MODEL, prompt=["Hello", "One two"], max_tokens=4, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]


def test_seed_reproducible_and_n(client):
    kwargs = dict(model=MODEL, messages=ask("Tell me a joke."), temperature=1.0, max_tokens=20)
    a = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert a == b
    r = client.chat.completions.create(n=3, seed=3, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # n>1 is honoured, not one answer thrice


def test_stop_string_across_token_boundaries(client):
    kwargs = dict(model=MODEL, messages=ask("Count from 3 to 7."), temperature=0, max_tokens=30)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) > 6
    # a stop string that starts inside one token and ends inside another
    stop = full[3:6]
    expected = full[:full.index(stop)].strip()  # message content is returned stripped
    r = client.chat.completions.create(stop=[stop], **kwargs)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    pieces = []
    for chunk in client.chat.completions.create(stop=[stop], stream=True, **kwargs):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
    assert "".join(pieces) == expected


def test_logprobs_have_bytes(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Hi"), temperature=0, max_tokens=5,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(t.bytes is not None and len(t.top_logprobs) == 3 for t in content)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace").strip()


def test_max_tokens_limits_and_finish_length(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Count from 1 to 50."), temperature=0,
                                       max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model=MODEL, messages=ask("Count from 1 to 50."), temperature=0,
                                       max_completion_tokens=2)
    assert r.usage.completion_tokens == 2
    finishes = [c.finish_reason for chunk in client.chat.completions.create(
        model=MODEL, messages=ask("Count from 1 to 50."), temperature=0, max_tokens=3, stream=True)
        for c in chunk.choices if c.finish_reason]
    assert finishes == ["length"]  # streamed, too


def test_sixteen_concurrent_streams_are_independent(server, client):
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(1, 17), range(5, 21))]
    expected = [client.chat.completions.create(model=MODEL, messages=ask(q), temperature=0,
                                               max_tokens=24).choices[0].message.content for q in questions]

    async def one(aclient, q):
        text = ""
        stream = await aclient.chat.completions.create(model=MODEL, messages=ask(q), temperature=0,
                                                       max_tokens=24, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
        return text

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(aclient, q) for q in questions))

    assert asyncio.run(main()) == expected


def test_disconnected_stream_frees_its_slot(server):
    body = {"model": MODEL, "messages": ask("Count from 1 to 500."), "max_tokens": 3000,
            "temperature": 1.0, "stream": True, "logit_bias": no_eos_bias()}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
        running = None
        deadline = time.time() + 5
        while time.time() < deadline:
            running = httpx.get(server.url + "/ready").json()["engine"]["running"]
            if running == 0:
                break
            time.sleep(0.1)
        assert running == 0


def test_disconnected_non_stream_request_frees_its_slot(server):
    body = {"model": MODEL, "messages": ask("Count from 1 to 500."), "max_tokens": 3000,
            "temperature": 1.0, "logit_bias": no_eos_bias()}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    deadline = time.time() + 5
    while time.time() < deadline:
        if httpx.get(server.url + "/ready").json()["engine"]["running"] == 0:
            return
        time.sleep(0.1)
    pytest.fail("the abandoned request kept its slot")


def test_reasoning_goes_to_reasoning_content(client):
    kwargs = dict(model=MODEL, messages=ask("What's the weather in Oslo?"), tools=TOOLS, temperature=0,
                  max_tokens=80, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    assert reasoning, "with thinking on, the model's <think> block is returned as reasoning_content"
    for text in (msg.content or "", reasoning):
        assert "<think>" not in text and "</think>" not in text
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += c.delta.content or ""
    assert streamed_reasoning.strip() == reasoning
    assert streamed_content.strip() == (msg.content or "")
    off = client.chat.completions.create(**{**kwargs, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert not off.choices[0].message.model_extra.get("reasoning_content")


def test_parallel_tool_calls_false_returns_one_call(client):
    kwargs = dict(model=MODEL, messages=ask("What's the weather in Oslo and in Paris?"), tools=TOOLS,
                  temperature=0, max_tokens=120)
    many = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    one = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message.tool_calls or []
    assert len(one) == min(1, len(many))


def test_cors_is_off_by_default(server):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_prefix_cache_holds_no_more_memory_than_it_counts():
    """Caches kept for prefix reuse are extracted from a batch; an MLX slice keeps its whole
    parent buffer alive, so each kept entry held every row of its batch (8x the bytes the cache
    counted and bounded). After 8 requests batched together, what MLX holds beyond the weights is
    what the prefix cache says it holds."""
    s = ServerProcess().wait_ready()
    try:
        before = httpx.get(s.url + "/metrics").text
        questions = [f"Name a colour that rhymes with {w}." for w in
                     ("bed", "blue", "bean", "sack", "pink", "fray", "sight", "sold")]

        async def main():
            aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
            return await asyncio.gather(*(aclient.chat.completions.create(
                model=MODEL, messages=ask(q), temperature=0, max_tokens=6) for q in questions))

        asyncio.run(main())
        after = httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
    held = metric_value(after, "mixbit_mlx_active_memory_bytes") - metric_value(before, "mixbit_mlx_active_memory_bytes")
    counted = metric_value(after, "mixbit_prefix_cache_bytes") - metric_value(before, "mixbit_prefix_cache_bytes")
    assert counted > 0
    assert held <= 1.25 * counted + (256 << 10), (held, counted)


def streamed_during_prefill(server_url: str, prompt_words: int) -> tuple[int, int]:
    """Stream A decodes; then a prompt of `prompt_words` words arrives (B, one token asked).
    Returns the chunks A received between B's request and B's answer, and B's prompt tokens."""
    words = " ".join(f"w{i % 97}" for i in range(prompt_words))

    async def main():
        ac = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
        seen: list[float] = []
        going = asyncio.Event()

        async def a():
            stream = await ac.completions.create(model=MODEL, prompt="Count from 1 to 500:", max_tokens=3000,
                                                 temperature=0, stream=True, logit_bias=no_eos_bias())
            async for _ in stream:
                seen.append(time.monotonic())
                if len(seen) == 3:
                    going.set()

        task = asyncio.create_task(a())
        await asyncio.wait_for(going.wait(), 120)
        sent = time.monotonic()
        b = await ac.completions.create(model=MODEL, prompt=words, max_tokens=1, temperature=0)
        done = time.monotonic()
        task.cancel()
        return sum(sent < t < done for t in seen), b.usage.prompt_tokens

    return asyncio.run(main())


def test_a_long_prompt_is_prefilled_in_rounds_while_streams_decode():
    """A prompt is prefilled in rounds of `server.prefill_tokens` tokens (across the prompts
    prefilled together), with a decode step for the running streams between rounds: a stream
    is not stalled for the whole of someone else's prompt. Counted, not timed: the chunks stream
    A receives while B's ~3,900-token prompt is prefilled in rounds of 32 (about 120 rounds; 91
    chunks when measured, against 2-3 with `server.prefill_tokens=4096`: one round, and A gets
    only what it decodes while B's request is parsed)."""
    s = ServerProcess("server.prefill_tokens=32").wait_ready()
    try:
        during, prompt_tokens = streamed_during_prefill(s.url, 1000)
    finally:
        s.stop()
    assert prompt_tokens > 3000
    assert during >= prompt_tokens // 32 // 3, (during, prompt_tokens)
