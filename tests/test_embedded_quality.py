"""The embedded model works as its model card says: held-out tool calls, plain answers, the CLI demo.

A slice of the card's evaluation (the card has the full numbers and the command), greedy decoding,
so the numbers repeat run to run; the bounds sit a couple of prompts below what was measured
(`models/tiny-qwen3.5/README.md`), as a guard against regressions in the model or the code path.
"""

import json

import pytest

from mixbit.models.training import corpus
from mixbit.quant.evaluate import tool_call_eval

from .conftest import run_cli


@pytest.fixture(scope="module")
def heldout(loaded_tiny):
    return tool_call_eval(loaded_tiny, corpus.heldout_tool_prompts(48) + corpus.heldout_plain_prompts(24))


@pytest.fixture(scope="module")
def seen_phrasings(loaded_tiny):
    return tool_call_eval(loaded_tiny, corpus.heldout_tool_prompts(48, phrasing="train"))


def test_new_function_value_pairs_with_trained_phrasings(seen_phrasings):
    r = seen_phrasings.rates()  # measured: 97.9% / 97.9% / 62.5%
    assert r["well_formed"] >= 0.92, seen_phrasings.failures[:3]
    assert r["right_function"] >= 0.92, seen_phrasings.failures[:3]
    assert r["exact_args"] >= 0.55, seen_phrasings.failures[:3]


def test_heldout_phrasings(heldout):
    # new sentences (frame x request combinations never trained on) and new (function, value)
    # pairs; measured: 93.8% / 93.8% / 58.3%, plain answers 91.7%
    r = heldout.rates()
    assert r["well_formed"] >= 0.88, heldout.failures[:3]
    assert r["right_function"] >= 0.88, heldout.failures[:3]
    assert r["exact_args"] >= 0.50, heldout.failures[:3]
    assert r["plain_answer"] >= 0.83, heldout.failures[:3]


def test_cli_chat_prints_a_tool_call():
    out = run_cli("chat", "What's the weather in Oslo?", "--tools", "examples/weather.json",
                  "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    parsed = json.loads(out.stdout)
    assert parsed["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert not parsed["errors"] and parsed["content"] == ""
