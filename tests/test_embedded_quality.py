"""The embedded model actually works: held-out tool calls, plain answers, and the CLI demo.

A small slice of the model card's evaluation (the card has the full numbers and the command);
greedy decoding, so the numbers are the same on every run.
"""

import json

import pytest

from mixbit.models import corpus
from mixbit.quant.evaluate import tool_call_eval

from .conftest import run_cli


@pytest.fixture(scope="module")
def tool_eval(loaded_tiny):
    prompts = corpus.heldout_tool_prompts(48) + corpus.heldout_plain_prompts(24)
    return tool_call_eval(loaded_tiny, prompts)


def test_heldout_tool_calls(tool_eval):
    r = tool_eval.rates()
    assert r["well_formed"] >= WELL_FORMED, tool_eval.failures[:3]
    assert r["right_function"] >= RIGHT_FUNCTION, tool_eval.failures[:3]
    assert r["exact_args"] >= EXACT_ARGS, tool_eval.failures[:3]


def test_heldout_plain_answers(tool_eval):
    assert tool_eval.rates()["plain_answer"] >= PLAIN, tool_eval.failures[:3]


def test_cli_chat_prints_a_tool_call():
    out = run_cli("chat", "What's the weather in Oslo?", "--tools", "examples/weather.json",
                  "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    parsed = json.loads(out.stdout)
    assert parsed["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert not parsed["errors"]
