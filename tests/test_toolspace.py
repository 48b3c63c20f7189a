"""The generated tool space (models/training/toolspace.py): what training shows, what it holds
out, and that held-out prompts are answerable from their words alone."""

import json
import random

import pytest

from mixbit.models.chat.toolcall import parse_output, parser_for_template
from mixbit.models.training import corpus
from mixbit.models.training import toolspace as T

HELDOUT_PARAM_NAMES = {c.names[-1] for c in T.CONCEPTS.values()}
UNSEEN_NAMES = {T._name_of(v, o) for v, o in T.pairs("unseen")}


def _training_docs(n=1500, seed=11):
    rng = random.Random(seed)
    return [corpus.document(rng, corpus.TOOLSPACE_MIX) for _ in range(n)]


def test_the_space_is_large_and_both_splits_are_populated():
    train, unseen = T.pairs("train"), T.pairs("unseen")
    assert len(train) >= 500 and len(unseen) >= 100
    assert not {T._name_of(v, o) for v, o in train} & UNSEEN_NAMES
    assert {o.words for _, o in unseen} >= T.HELDOUT_OBJECTS
    # distinct signatures (name, parameter names): thousands, not a catalogue
    rng = random.Random(0)
    sigs = {(t.name, t.params) for t in (T.make_tool(v, o, rng, "train") for v, o in train * 8)}
    assert len(sigs) > 2000


def test_training_never_shows_an_unseen_function_object_or_parameter_name():
    seen_names, seen_params, text = set(), set(), []
    for doc in _training_docs():
        for tool in doc["tools"] or []:
            fn = tool["function"]
            seen_names.add(fn["name"])
            seen_params |= set(fn["parameters"]["properties"])
            text.append(fn["description"].lower())
        text += [m.get("content") or "" for m in doc["messages"]]
    assert not seen_names & UNSEEN_NAMES
    assert not seen_params & HELDOUT_PARAM_NAMES
    joined = " ".join(text).lower()
    for word in T.HELDOUT_OBJECTS:
        assert f" {word} " not in joined and f" {word}s " not in joined, word
    kinds = {d["kind"] for d in _training_docs(400, seed=3)}
    assert {"gen_tool", "gen_no_fit", "gen_two", "agent", "tool", "no_tool", "no_tool_gen"} <= kinds


def _user_words(prompt):
    return prompt.messages[-1]["content"]


def _mentioned(concept, value, text):
    if concept.type == "boolean":
        return any(m in text for m in (concept.mentions if value else concept.false_mentions))
    if concept.type == "array":
        return all(item in text for item in value)
    return str(value) in text


def test_unseen_prompts_name_an_offered_unseen_function_and_carry_every_value():
    prompts = corpus.unseen_tool_prompts(120)
    types = set()
    for p in prompts:
        name = p.expected["name"]
        offered = {t["function"]["name"]: t["function"] for t in p.tools}
        assert name in UNSEEN_NAMES and name in offered
        params = offered[name]["parameters"]["properties"]
        assert set(params) & HELDOUT_PARAM_NAMES, params
        assert len(offered) >= 2  # never alone: decoys or others beside it
        for pname, value in p.expected["arguments"].items():
            types.add(params[pname]["type"])
            concept = next(c for c in T.CONCEPTS.values() if pname in c.names)
            assert _mentioned(concept, value, _user_words(p)), (pname, value, _user_words(p))
    assert {"string", "integer", "number", "boolean", "array"} <= types


def test_no_fit_prompts_offer_decoys_that_share_the_requests_words_but_not_the_function():
    for p in corpus.unseen_no_fit_prompts(60):
        assert p.expected is None
        names = [t["function"]["name"] for t in p.tools]
        text = _user_words(p).lower()
        # some offered tool shares the request's object or its verb
        parts = {T._name_of(v, o): (v, o) for v, o in T.ALL_PAIRS}
        shared = [n for n in names if T.VERBS[parts[n][0]].requests[0].split()[0] in text
                  or parts[n][1].words in text or parts[n][1].plural in text]
        assert shared, (text, names)


def test_two_tool_prompts_expect_two_different_offered_functions():
    for p in corpus.unseen_two_tool_prompts(20):
        names = [c["name"] for c in p.expected_all]
        assert len(set(names)) == 2 and p.expected == p.expected_all[0]
        assert set(names) <= {t["function"]["name"] for t in p.tools}


@pytest.mark.parametrize("seed", range(6))
def test_every_argument_type_survives_the_chat_template_and_the_servers_parser(seed, loaded_tiny):
    """A trained call, rendered by the checkpoint's template, parses back to the same JSON
    arguments with the server's parser: booleans, lists and numbers included."""
    rng = random.Random(seed)
    parser = parser_for_template(loaded_tiny.chat_template)
    for _ in range(20):
        doc = T.two_tool_episode(rng, "train")
        calls = doc["messages"][1]["tool_calls"]
        text = loaded_tiny.tokenizer.apply_chat_template(
            doc["messages"][:2], tools=doc["tools"], tokenize=False)
        body = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
        body = body.split("<|im_end|>")[0]
        if body.startswith("<think>"):
            body = body.split("</think>", 1)[1]
        parsed = parse_output(body.strip(), parser, doc["tools"], False)
        assert not parsed.errors, parsed.errors
        got = [(c.name, c.arguments) for c in parsed.tool_calls]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_training_renames_parameters_and_objects_and_held_out_sets_never_change(monkeypatch):
    """Training shows composed parameter names and made-up objects (so a name is copied from the
    offered schema, not recalled), never a held-out name; the rates are training-only: every
    held-out prompt is the same whatever they are."""
    trained = {n for c in T.CONCEPTS.values() for n in c.names[:-1]}
    objects = {o.words for o in T.OBJECTS} | {o.plural for o in T.OBJECTS}
    composed, made_up = set(), set()
    for doc in _training_docs(600, seed=5):
        for tool in doc["tools"] or []:
            fn = tool["function"]
            if doc["kind"].startswith("gen") and "_" in fn["name"]:
                noun = fn["name"].split("_", 1)[1].replace("_", " ")
                made_up |= {noun} - objects - {f.name for f in corpus.C.FUNCTIONS}
            composed |= set(fn["parameters"]["properties"]) - trained
    assert len(composed) > 150 and not composed & T.HELDOUT_PARAM_NAMES
    assert len(made_up) > 30

    def held_out():
        return [json.dumps([p.messages, p.tools, p.expected], sort_keys=True)
                for p in corpus.unseen_tool_prompts(40) + corpus.unseen_no_fit_prompts(20)
                + corpus.unseen_plain_prompts(20) + corpus.unseen_two_tool_prompts(10)]

    before = held_out()
    monkeypatch.setattr(T, "RENAME_PARAM", 1.0)
    monkeypatch.setattr(T, "MADE_UP_OBJECT", 1.0)
    assert held_out() == before
    monkeypatch.setattr(T, "RENAME_PARAM", 0.0)
    monkeypatch.setattr(T, "MADE_UP_OBJECT", 0.0)
    assert held_out() == before
    plain = {n for d in _training_docs(200, seed=5) for t in d["tools"] or []
             if d["kind"].startswith("gen") for n in t["function"]["parameters"]["properties"]}
    assert plain <= trained | {n for f in corpus.C.FUNCTIONS for n in
                               f.schema()["function"]["parameters"]["properties"]}
