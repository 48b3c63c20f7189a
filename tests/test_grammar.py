"""Grammar-constrained decoding with the embedded model: random schemas always validate, tool
grammars only admit offered functions with valid arguments, and what cannot be enforced is
refused. (The server-level behaviour, through the openai SDK, is in test_server_tools.py.)"""

import json
import random

import jsonschema
import pytest
from mlx_lm.generate import stream_generate

from mixbit.models.chat.template import render_chat
from mixbit.models.chat.toolcall import XmlToolParser, parse_output
from mixbit.models.chat.grammar import (GrammarEngine, GrammarError, chat_grammar, json_grammar,
                                   strictify, tool_call_grammar)
from mixbit.server.sampling import SamplingParams, make_sampler

from .schemas import random_schema


@pytest.fixture(scope="module")
def grammar(loaded_tiny):
    cfg = loaded_tiny.config.get("text_config", loaded_tiny.config)
    return GrammarEngine(loaded_tiny.tokenizer._tokenizer, cfg["vocab_size"],
                         sorted(loaded_tiny.tokenizer.eos_token_ids))


def generate(lm, grammar, text: str, prompt: str, seed: int, max_tokens: int = 400,
             tools=None, thinking=False):
    prompt_text = render_chat(lm.tokenizer, [{"role": "user", "content": prompt}], tools,
                              enable_thinking=thinking)
    ids = lm.tokenizer.encode(prompt_text, add_special_tokens=False)
    proc = grammar.processor(grammar.compile(text))
    out, finish = "", None
    for r in stream_generate(lm.model, lm.tokenizer, ids, max_tokens=max_tokens,
                             sampler=make_sampler(SamplingParams(temperature=1.0, seed=seed)),
                             logits_processors=[proc]):
        out += r.text
        finish = r.finish_reason
    assert proc.failed is None, proc.failed
    return out, finish


def generate_side_by_side(lm, grammar, jobs: list[tuple[str, str, int]], max_tokens: int = 400,
                          batch: int = 16) -> list[tuple[str, str]]:
    """(grammar, prompt, seed) jobs sampled at temperature 1 in mixbit's decode loop, `batch`
    sequences side by side with a grammar and a seeded sampler each, as the server runs
    concurrent requests: (text, finish reason) per job."""
    from mixbit.server.batching import BatchLoop

    loop = BatchLoop(lm.model, stop_tokens=sorted(lm.tokenizer.eos_token_ids), max_batch=batch)
    procs, tokens, finish = {}, {}, {}
    for text, prompt, seed in jobs:
        ids = lm.tokenizer.encode(render_chat(lm.tokenizer, [{"role": "user", "content": prompt}], None,
                                              enable_thinking=False), add_special_tokens=False)
        proc = grammar.processor(grammar.compile(text))
        sampler = make_sampler(SamplingParams(temperature=1.0, seed=seed))
        uid = loop.insert([ids], max_tokens, sampler=sampler, processors=[proc], draws=sampler)
        procs[uid], tokens[uid] = proc, []
    while len(loop):
        for g in loop.next()[1]:
            if g.finish_reason != "stop":
                tokens[g.uid].append(g.token)
            if g.finish_reason:
                finish[g.uid] = g.finish_reason
    for uid, proc in procs.items():
        assert proc.failed is None, proc.failed
    return [(lm.tokenizer.decode(tokens[u]), finish[u]) for u in procs]


def test_200_random_schemas_always_validate(loaded_tiny, grammar):
    rng = random.Random(7)
    features = {"anyOf": 0, "$ref": 0, "enum": 0, "array": 0}
    schemas = [random_schema(rng) for _ in range(200)]
    for schema in schemas:
        dumped = json.dumps(schema)
        for key in features:
            features[key] += key in dumped if key != "array" else '"array"' in dumped
    assert all(n >= 10 for n in features.values()), features  # the mix covers every feature
    jobs = [(json_grammar(s, True, False), f"Reply with JSON for {', '.join(s['properties'])}.", i)
            for i, s in enumerate(schemas)]
    for i, (schema, (text, finish)) in enumerate(zip(schemas, generate_side_by_side(loaded_tiny, grammar, jobs))):
        assert finish == "stop", (i, schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_an_object(loaded_tiny, grammar):
    for seed in range(5):
        text, finish = generate(loaded_tiny, grammar, json_grammar(None, False, False),
                                "Tell me a joke.", seed=seed, max_tokens=600)
        if finish == "stop":  # free-form objects can outgrow a budget; finished ones must parse
            assert isinstance(json.loads(text), dict)


def test_strict_closes_open_objects():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "array", "items": {"type": "object"}}}}
    out = strictify(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is untouched


TOOLS = [
    {"type": "function", "function": {"name": "set_timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90},
                                         "label": {"type": "string"}},
        "required": ["minutes"]}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
]


@pytest.mark.parametrize("prompt", ["Tell me a joke.", "What is 3 plus 4?", "Set a timer for 500 minutes."])
def test_required_tool_call_always_names_an_offered_function_with_valid_arguments(loaded_tiny, grammar, prompt):
    g = chat_grammar(TOOLS, "required", True, None, False, "xml")
    for seed in range(4):
        text, finish = generate(loaded_tiny, grammar, g, prompt, seed, tools=TOOLS)
        assert finish == "stop"
        parsed = parse_output(text, XmlToolParser(), TOOLS, False)
        assert parsed.tool_calls and not parsed.content, text
        for call in parsed.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.name)
            jsonschema.validate(call.arguments, tool["function"]["parameters"])


def test_named_function_is_the_one_called(loaded_tiny, grammar):
    g = chat_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False,
                     None, False, "xml")
    text, _ = generate(loaded_tiny, grammar, g, "Set a timer for 5 minutes.", 0, tools=TOOLS)
    calls = parse_output(text, XmlToolParser(), TOOLS, False).tool_calls
    assert [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments["unit"] in ("c", "f")


def test_thinking_stays_free_and_the_constraint_starts_after_it(loaded_tiny, grammar):
    g = chat_grammar(None, None, True, {"type": "json_object"}, True, "xml")
    text, finish = generate(loaded_tiny, grammar, g, "Make a JSON object for Anna who is 31 "
                            "years old, keys name and age.", 0, thinking=True, max_tokens=300)
    parsed = parse_output(text, XmlToolParser(), None, True)
    assert finish == "stop"
    assert isinstance(json.loads(parsed.content), dict)


def test_what_cannot_be_enforced_is_refused(grammar):
    with pytest.raises(GrammarError, match="pattern"):
        tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}])
    with pytest.raises(GrammarError, match="format"):
        grammar.compile(json_grammar({"type": "object", "properties": {
            "a": {"type": "string", "format": "no-such-format"}}}, True, False))
    with pytest.raises(GrammarError, match="not among the tools"):
        chat_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}}, True, None,
                     False, "xml")


def test_compiled_grammars_are_cached(grammar):
    g = json_grammar({"type": "object", "properties": {"q": {"type": "integer"}}}, True, False)
    first = grammar.compile(g)
    hits = grammar.hits
    assert grammar.compile(g) is first and grammar.hits == hits + 1


@pytest.mark.parametrize("vocabulary", ["embedded", "qwen3.5"])
def test_grammar_engine_shares_the_models_tokenizer(loaded_tiny, vocabulary):
    """llguidance's tokenizer is built over the model's own tokenizer (token bytes and a tokenize
    callback), not over a second parsed copy of it: every token's bytes and special flag, and
    the tokenization of text, are what llguidance's own Hugging Face path gives, for a fraction
    of the memory (Qwen3.5's 248,320-token vocabulary: a second copy is +431 MB)."""
    import gc
    import sys

    import llguidance.hf

    from mixbit.models.chat.grammar import _byte_level, _shared_tokenizer
    from mixbit.server.metrics import _rss_bytes as _rss

    if vocabulary == "embedded":
        hf = loaded_tiny.tokenizer._tokenizer
        n = loaded_tiny.config.get("text_config", loaded_tiny.config)["vocab_size"]
    else:
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "bench"))
        from qwen_vocab import VOCAB_SIZE, build

        hf, n = build(), VOCAB_SIZE
    eos = [hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert _byte_level(hf)
    gc.collect()
    before = _rss()
    shared = _shared_tokenizer(hf, n, eos)
    gc.collect()
    grown = _rss() - before
    ref = llguidance.hf.from_tokenizer(hf, n_vocab=n, eos_token=eos)
    gc.collect()
    ref_grown = _rss() - before - grown
    differ = [i for i in range(n) if shared.decode_bytes([i]) != ref.decode_bytes([i])
              or shared.is_special_token(i) != ref.is_special_token(i)]
    assert not differ, [(ref.dbg_tokens([i]), shared.dbg_tokens([i])) for i in differ[:5]]
    for text in ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                 "naïve café 東京 🙂", "<|im_end|>x</think>", "  spaces\t\ttabs\n\n"]:
        assert shared.tokenize_str(text) == ref.tokenize_str(text)
        assert shared.tokenize_bytes(text.encode()[:11]) == ref.tokenize_bytes(text.encode()[:11])
    if vocabulary == "qwen3.5":
        assert grown < ref_grown / 3, (grown, ref_grown)
