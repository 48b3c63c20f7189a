"""The spot-check worker on the embedded model: chunked teacher forcing computes what one pass
does, a model checked against itself agrees everywhere, and the worker yields to serving."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from mixbit.server.fidelity import (FidelityWorker, Job, LocalReference, chunked_logprobs,
                                    compare, forward_logprobs)
from mixbit.server.metrics import Metrics


class _State:  # what the metrics' engine collector reads; no engine in these tests
    variants: list = []
    ready = False
    fidelity = None
    startup = None


def _ids(loaded, n_prompt=37, n_gen=29):
    text = "The weather in Oslo is cold today, and the tool returns a JSON answer. " * 4
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= n_prompt + n_gen
    return ids[:n_prompt + n_gen], n_prompt


def test_chunked_teacher_forcing_equals_one_pass(loaded_tiny):
    ids, start = _ids(loaded_tiny)
    whole = forward_logprobs(loaded_tiny.model, ids, start)
    for chunk in (8, 16, 50, 512):  # chunks that split the prompt, the boundary, the answer
        rows = list(chunked_logprobs(loaded_tiny.model, ids, start, chunk))
        assert [i for i, _ in rows] == [sum(lp.shape[0] for _, lp in rows[:k]) for k in range(len(rows))]
        got = mx.concatenate([lp for _, lp in rows])
        assert got.shape == whole.shape == (len(ids) - start, whole.shape[-1])
        assert float(mx.abs(got - whole).max().item()) < 1e-3, chunk


def _worker(loaded, **kw) -> FidelityWorker:
    ref = LocalReference(lambda: loaded.model, "itself")
    w = FidelityWorker(ref, Metrics(_State()), sample_rate=1.0,
                       max_per_minute=1000, queue_size=4, max_tokens=256, keep=10, chunk=16, **kw)
    w.start()
    return w


def _checked(loaded, job: Job):
    """Offers `job` to a worker comparing the model with itself; the finished check."""
    w = _worker(loaded)
    try:
        assert w.offer(job)
        deadline = time.time() + 60
        while not w.recent and time.time() < deadline:
            time.sleep(0.05)
        return w.recent[-1]
    finally:
        w.close()


def test_model_against_itself_agrees_everywhere(loaded_tiny):
    ids, start = _ids(loaded_tiny)
    lp = forward_logprobs(loaded_tiny.model, ids, start)
    top = np.array(mx.argmax(lp, axis=-1))
    tokens = ids[start:]
    check = _checked(loaded_tiny, Job(kind="chat", prompt=ids[:start], tokens=tokens, request_id="r1",
                                         variant="bf16", model=loaded_tiny.model))
    assert check.tokens == len(tokens)
    assert check.kld_mean < 1e-5 and check.top1_agreement == 1.0 and check.first_divergence is None
    # a flip is a generated token that was not the reference's top-1: the text here is not the
    # model's own greedy output, so some positions flip, exactly those
    assert check.flips == int(np.sum(top != np.array(tokens)))
    # and the same numbers as comparing the one-pass distributions directly
    direct = compare(lp, lp, tokens)
    assert direct["flips"] == check.flips and direct["tokens"] == check.tokens


def test_worker_waits_while_serving_is_busy_and_runs_when_idle(loaded_tiny):
    ids, start = _ids(loaded_tiny)
    busy = threading.Event()
    busy.set()
    w = _worker(loaded_tiny, busy=busy.is_set, busy_share=0.0)  # 0: check only while idle
    try:
        assert w.offer(Job(kind="json", prompt=ids[:start], tokens=ids[start:], request_id="r2",
                                 variant="bf16", model=loaded_tiny.model))
        time.sleep(3.0)  # a check takes well under a second here; busy holds it after one slice
        assert not w.recent, "the check ran although serving was busy"
        assert w.queue.qsize() == 0  # taken from the queue, resting between slices
        busy.clear()
        deadline = time.time() + 60
        while not w.recent and time.time() < deadline:
            time.sleep(0.05)
        assert w.recent and w.recent[-1].kind == "json"
    finally:
        w.close()


def test_constrained_output_compared_over_what_the_grammar_allowed(loaded_tiny):
    """A greedy answer decoded under a JSON grammar, checked against the same model: every token
    was the top-1 of what the grammar allowed, so nothing flips and the distributions agree.
    Compared unconstrained, forced tokens would count as flips (the model would rather talk)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mixbit.models.chat.grammar import GrammarEngine, json_grammar
    from mixbit.models.chat.template import render_chat

    cfg = loaded_tiny.config.get("text_config", loaded_tiny.config)
    engine = GrammarEngine(loaded_tiny.tokenizer._tokenizer, cfg["vocab_size"],
                           sorted(loaded_tiny.tokenizer.eos_token_ids))
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    compiled = engine.compile(json_grammar(schema, strict=True, thinking=False))
    prompt = render_chat(loaded_tiny.tokenizer, [{"role": "user", "content": "Hi, I am Anna. Tell me a joke."}])
    ids = loaded_tiny.tokenizer.encode(prompt, add_special_tokens=False)
    tokens = [r.token for r in stream_generate(loaded_tiny.model, loaded_tiny.tokenizer, ids, max_tokens=48,
                                               sampler=make_sampler(temp=0.0),
                                               logits_processors=[engine.processor(compiled)])]
    unconstrained = compare(*(2 * [forward_logprobs(loaded_tiny.model, ids + tokens, len(ids))]), tokens)
    assert unconstrained["flips"] > 0, "the prompt should make the grammar force tokens"
    check = _checked(loaded_tiny, Job(kind="json", prompt=ids, tokens=tokens, request_id="r3", grammar=compiled,
                                         variant="bf16", model=loaded_tiny.model))
    assert check.tokens == len(tokens) and check.flips == 0
    assert check.top1_agreement == 1.0 and check.kld_mean < 1e-5
