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


def test_eval_reports_functions_never_seen_in_training(loaded_tiny):
    """`mixbit eval`'s numbers on the generated tool space's held-out functions: calls among
    decoys, two calls in one request, requests no offered tool fits, questions needing none."""
    from mixbit.quant.report import run_model_eval

    report = run_model_eval(loaded_tiny, n_tool=6, n_plain=4, n_docs=8, soak_rounds=2)
    u = report["unseen_functions"]
    assert u["calls"]["n"] == 6 and u["two_calls"]["n"] == 2
    assert u["no_tool_fits"]["n"] == 4 and u["needs_no_tool"]["n"] == 4
    for rate in (u["calls"]["right_function"], u["calls"]["exact_args"],
                 u["no_tool_fits"]["plain_answer"], u["needs_no_tool"]["plain_answer"]):
        assert 0.0 <= rate <= 1.0
    assert u["calls"]["exact_args"] <= u["calls"]["right_function"] <= u["calls"]["well_formed"]
    table = report["table"]
    assert "functions never seen in training" in table
    assert "plain answer when no offered tool fits" in table
    assert "up to 2 rounds" in table
    generated = set(report["heldout_loss"]) & set(corpus.GENERATED_MIX)
    assert generated and set(report["heldout_loss"]) - generated  # both kinds of documents
