"""Greedy outputs of the embedded model through every route, against a recording.

`tests/fixtures/golden_outputs.json` holds what the server answered (text, tool calls, token
ids and logprobs) for the same requests, recorded before mixbit's own Qwen3.5 forward replaced
mlx-lm's at serving time: the forward may change how it computes, never what. Texts and token
ids must match exactly, logprobs within 1e-4. Record again only on purpose (a new checkpoint, a
new quantizer: uniform-4 was recorded again when the writer began fitting scales, 2026-12-07):

    MIXBIT_RECORD_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden_outputs.py
"""

from __future__ import annotations

import json
import os

import anthropic
import httpx
import openai
import pytest

from .conftest import ROOT, WEATHER
from .server_proc import ServerProcess

MODEL = "tiny-qwen3.5"
FIXTURE = ROOT / "tests" / "fixtures" / "golden_outputs.json"
RECORD = os.environ.get("MIXBIT_RECORD_GOLDEN") == "1"
LOGPROB_TOL = 1e-4
# bf16 and uniform-4 on the packed kernels (the output head, and so GatedDeltaNet's fused decode
# step), float32 activations: a rule plan, which does not depend on timing
VARIANTS = {
    "bf16": dict(recipe="bf16", settings=('generation.cpu_quantized="packed"',
                                          'generation.cpu_activations="float32"')),
    "uniform-4": dict(recipe="uniform-4", settings=('generation.cpu_quantized="packed"',
                                                    'generation.cpu_activations="float32"')),
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}


def _chat(client, messages, **kw) -> dict:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, logprobs=True,
                                       top_logprobs=2, **kw)
    c = r.choices[0]
    return {"content": c.message.content, "finish": c.finish_reason,
            "tool_calls": [[t.function.name, json.loads(t.function.arguments)]
                           for t in c.message.tool_calls or []],
            # alternatives a grammar ruled out all sit at -9999 (-inf): which of them shows is arbitrary
            "logprobs": [[t.token, t.logprob, [[a.token, a.logprob] for a in t.top_logprobs if a.logprob > -9999]]
                         for t in (c.logprobs.content or [])] if c.logprobs else []}


def _answers(url: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    out = {
        "chat": _chat(client, [{"role": "user", "content": "Hi, I am Anna. Tell me a joke."}], max_tokens=32),
        "tool_call": _chat(client, [{"role": "user", "content": "What is the weather in Oslo?"}],
                           tools=WEATHER, max_tokens=48),
        "forced_tool": _chat(client, [{"role": "user", "content": "Time for tea."}], tools=WEATHER,
                             tool_choice={"type": "function", "function": {"name": "set_timer"}},
                             max_tokens=48),
        "json_schema": _chat(client, [{"role": "user", "content": "A city and a number of days, as JSON."}],
                             max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                                 "name": "trip", "schema": CITY, "strict": True}}),
    }
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The weather in Paris is", "max_tokens": 16, "temperature": 0,
        "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    out["completion"] = {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}
    m = claude.messages.create(model=MODEL, max_tokens=48, temperature=0, messages=[
        {"role": "user", "content": "What's the weather in Oslo?"}], tools=[{
            "name": "get_weather", "description": "Get the current weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
    out["anthropic"] = [[b.type, getattr(b, "text", None) or getattr(b, "input", None)] for b in m.content]
    resp = client.responses.create(model=MODEL, input="Tell me a joke.", temperature=0, max_output_tokens=32)
    out["responses"] = resp.output_text
    return out


def _close(got, want, path="") -> list[str]:
    """Where `got` differs from `want`: floats by more than LOGPROB_TOL, anything else at all."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        return [] if abs(got - want) <= LOGPROB_TOL else [f"{path}: {got} vs {want}"]
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _close(g, w, f"{path}[{i}]")]
    if isinstance(want, dict) and isinstance(got, dict) and got.keys() == want.keys():
        return [d for k in want for d in _close(got[k], want[k], f"{path}.{k}")]
    return [] if got == want else [f"{path}: {got!r} vs {want!r}"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_are_the_recorded_ones(variant, tmp_path_factory):
    spec = VARIANTS[variant]
    cache = tmp_path_factory.mktemp(f"golden-{variant}")
    server = ServerProcess("server.request_timeout_s=120", *spec["settings"], recipe=spec["recipe"],
                           cache_dir=str(cache)).wait_ready(600)
    try:
        got = _answers(server.url)
    finally:
        server.stop()
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}
    if RECORD:
        recorded[variant] = got
        FIXTURE.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    assert variant in recorded, f"no recording for {variant}: run with MIXBIT_RECORD_GOLDEN=1"
    assert got["tool_call"]["tool_calls"], "the recording must exercise a tool call"
    diffs = _close(got, recorded[variant])
    assert not diffs, "\n".join(diffs[:20])
