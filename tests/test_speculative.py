"""Self-speculative decoding with the embedded model's MTP head (server/speculative.py).

What a user sees must not change: greedy outputs are token-identical with and without drafting
(the recording of tests/test_golden_outputs.py, made before the head existed, through every
route), sampled outputs keep the model's distribution (a chi-square test of the exact
probabilities at the positions a verify step produces), a seed repeats itself, and the server
says what it does: `/v1/models` (the speculative card) and `/metrics` (vLLM's counters).
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from . import test_golden_outputs as golden
from .server_proc import ServerProcess, metric_value

MODEL = "tiny-qwen3.5"
PLAN = ('generation.cpu_quantized="packed"', 'generation.cpu_activations="float32"')
PROMPT = [{"role": "user", "content": "Hi, I am Anna. Tell me about the weather in Oslo."}]
JOKE = [{"role": "user", "content": "Tell me a joke."}]  # the first token is "Why" 0.71, "I" 0.29


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The embedded model served three times, on the same plan: drafting 3 tokens a step, off,
    and as configured (generation.mtp = "auto")."""
    out = {}
    try:
        for name, mtp in (("on", ("generation.mtp=true", "generation.mtp_drafts=3")),
                          ("off", ("generation.mtp=false",)), ("auto", ())):
            out[name] = ServerProcess("server.request_timeout_s=120", *PLAN, *mtp, recipe="bf16",
                                      cache_dir=str(tmp_path_factory.mktemp(f"spec-{name}")))
        for s in out.values():
            s.wait_ready(600)
        yield out
    finally:
        for s in out.values():
            s.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_outputs_with_drafting_are_the_recorded_ones(servers):
    """Chat, tool calls (auto and forced), json_schema, completions, Anthropic and Responses:
    what the server answered before the MTP head existed, token for token."""
    on = servers["on"]
    before = httpx.get(on.url + "/metrics").text
    got = golden._answers(on.url)
    recorded = json.loads(golden.FIXTURE.read_text())["bf16"]
    diffs = golden._close(got, recorded)
    assert not diffs, "\n".join(diffs[:20])
    after = httpx.get(on.url + "/metrics").text
    drafted = metric_value(after, "mixbit_spec_decode_num_draft_tokens_total") - \
        metric_value(before, "mixbit_spec_decode_num_draft_tokens_total")
    accepted = metric_value(after, "mixbit_spec_decode_num_accepted_tokens_total") - \
        metric_value(before, "mixbit_spec_decode_num_accepted_tokens_total")
    steps = metric_value(after, "mixbit_spec_decode_num_drafts_total") - metric_value(before, "mixbit_spec_decode_num_drafts_total")
    assert steps > 0 and drafted > steps, "three drafts a step: the requests must have drafted"
    assert 0 < accepted <= drafted, "the trained head's drafts are accepted at times, never beyond what it drafted"
    by_position = [metric_value(after, "mixbit_spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                   for j in range(3)]
    assert by_position[0] >= by_position[1] >= by_position[2], "a later draft is kept only after the earlier ones"
    assert sum(by_position) == metric_value(after, "mixbit_spec_decode_num_accepted_tokens_total")


def test_models_say_whether_drafting_is_on(servers):
    on = httpx.get(servers["on"].url + "/v1/models").json()["data"][0]["mixbit"]["speculative"]
    off = httpx.get(servers["off"].url + "/v1/models").json()["data"][0]["mixbit"]["speculative"]
    assert on["method"] == "mtp" and on["drafts"] == 3
    assert on["draft_vocab"] == "all", "4,096 tokens: fewer than generation.mtp_draft_vocab"
    assert off["method"] is None and "generation.mtp" in off["reason"]
    text = httpx.get(servers["off"].url + "/metrics").text
    assert metric_value(text, "mixbit_spec_decode_num_drafts_total") == 0
    # "auto": on or off as the crossover measured on this machine, which the card shows
    auto = httpx.get(servers["auto"].url + "/v1/models").json()["data"][0]["mixbit"]["speculative"]
    measured = auto["crossover"]
    assert measured["plain_step_ms"] > 0 and measured["drafting_step_ms"] > 0
    assert (auto["method"] == "mtp") == measured["pays"]
    if not measured["pays"]:
        assert "measured slower" in auto["reason"]


@pytest.mark.parametrize("case", ["penalties", "stream_stop", "logprobs_long"])
def test_requests_answer_the_same_with_and_without_drafting(servers, case):
    """Processors (penalties, logit_bias), stop strings while streaming, long logprobs runs."""
    def ask(server):
        client = _client(server)
        if case == "penalties":
            r = client.chat.completions.create(model=MODEL, messages=JOKE, temperature=0, max_tokens=40,
                                               presence_penalty=0.8, frequency_penalty=0.4,
                                               logit_bias={"13": -5})
            return r.choices[0].message.content
        if case == "stream_stop":
            stream = client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=0, max_tokens=60,
                                                    stop=["."], stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        r = client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=0, max_tokens=80,
                                           logprobs=True, top_logprobs=3)
        return [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]

    assert ask(servers["on"]) == ask(servers["off"])


def test_a_seed_repeats_itself_while_drafting(servers):
    client = _client(servers["on"])
    runs = [client.chat.completions.create(model=MODEL, messages=JOKE, temperature=1.0, max_tokens=40,
                                           seed=11).choices[0].message.content for _ in range(2)]
    other = client.chat.completions.create(model=MODEL, messages=JOKE, temperature=1.0, max_tokens=40,
                                           seed=12).choices[0].message.content
    assert runs[0] == runs[1]
    assert other != runs[0], "another seed draws other tokens (the sampler is not greedy)"


# ---------------------------------------------------------------- the distribution, in process
def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x) (Wilson-Hilferty; good to ~1e-3 at these degrees of freedom)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _exact_triples(lm, prompt, params):
    """P(x1, x2, x3) of the model's sampling distribution (top-k, temperature), by plain
    forwards of the whole sequence."""
    import mlx.core as mx

    from mixbit.server.sampling import Sampler
    from mixbit.server.speculative import normalise

    sampler = Sampler(params)

    def dist(tokens):
        logits = lm.model(mx.array([tokens]))[0].astype(mx.float32)
        probs = mx.softmax(sampler.logits(normalise(logits)), axis=-1)
        return probs

    out = {}
    p1 = dist(prompt)[-1]
    for x1 in mx.argsort(-p1)[:params.top_k].tolist():
        p2 = dist(prompt + [x1])[-1]
        for x2 in mx.argsort(-p2)[:params.top_k].tolist():
            p3 = dist(prompt + [x1, x2])[-1]
            for x3 in mx.argsort(-p3)[:params.top_k].tolist():
                out[(x1, x2, x3)] = p1[x1].item() * p2[x2].item() * p3[x3].item()
    return out


def test_sampled_tokens_keep_the_models_distribution(loaded_tiny):
    """The rejection rule leaves every position distributed as the model's own sampling
    distribution: 3-token continuations drawn while drafting 2 tokens a step (x1 from the
    prefill, x2 and x3 from one verify step: a draft kept, or the token drawn on rejection)
    (the fourth token, when both drafts are kept, is left out) against their exact probabilities, in a chi-square goodness-of-fit test."""
    from mixbit.models.chat.template import render_chat
    from mixbit.server.batching import BatchLoop
    from mixbit.server.sampling import SamplingParams, Sampler
    from mixbit.server.speculative import SpecCounters, Speculation

    lm = loaded_tiny
    assert lm.model.mtp is not None, "the embedded checkpoint ships an MTP head"
    prompt = lm.tokenizer.encode(render_chat(lm.tokenizer, JOKE, enable_thinking=False), add_special_tokens=False)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4)
    exact = _exact_triples(lm, prompt, params)
    assert abs(sum(exact.values()) - 1) < 1e-3
    counters = SpecCounters()
    loop = BatchLoop(lm.model, stop_tokens=[], speculate=Speculation(drafts=2), counters=counters)
    n, counts = 800, {}
    for seed in range(n):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        uid = loop.insert([prompt], params.max_tokens, sampler=sampler, draws=sampler)
        tokens = []
        while len(loop):
            tokens += [g.token for g in loop.next()[1] if g.uid == uid]
        tokens = tokens[:3]
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert counters.drafts == n and counters.draft_tokens == 2 * n
    assert 0 < counters.accepted_tokens < 2 * n, "drafts are both kept and rejected: both branches are tested"
    assert set(counts) <= set(exact), "only tokens within top-k"
    # cells expected fewer than 5 times go together
    small = [t for t, p in exact.items() if p * n < 5]
    cells = [([t], p) for t, p in exact.items() if p * n >= 5] + [(small, sum(exact[t] for t in small))]
    stat = sum((sum(counts.get(t, 0) for t in ts) - p * n) ** 2 / (p * n) for ts, p in cells if p > 0)
    df = sum(1 for _, p in cells if p > 0) - 1
    assert _chi2_sf(stat, df) > 1e-3, f"chi2 {stat:.1f} on {df} degrees of freedom: {sorted(counts.items())}"


def test_drafts_over_a_reduced_vocabulary(loaded_tiny):
    """FR-Spec: the head drafts only the most frequent tokens (and every special token); the
    output is the model's, token for token, whatever the drafts."""
    import mlx.core as mx

    from mixbit.models.chat.template import render_chat
    from mixbit.server.batching import BatchLoop
    from mixbit.server.speculative import SpecCounters, Speculation, draft_vocabulary

    lm, model = loaded_tiny, loaded_tiny.model
    ids = draft_vocabulary(lm.hf_tokenizer, 512)
    assert len(ids) == 512 and set(lm.hf_tokenizer.all_special_ids) <= set(ids)
    assert draft_vocabulary(lm.hf_tokenizer, 10**6) is None, "the whole vocabulary: no reduction"
    prompts = [lm.tokenizer.encode(render_chat(lm.tokenizer, m, enable_thinking=False), add_special_tokens=False)
               for m in (JOKE, PROMPT)]
    hidden = mx.random.normal((1, 64, model.language_model.args.hidden_size))

    def run(spec):
        loop, out = BatchLoop(model, stop_tokens=sorted(lm.tokenizer.eos_token_ids), speculate=spec,
                              counters=SpecCounters()), []
        for p in prompts:
            uid = loop.insert([p], 48)
            tokens = []
            while len(loop):
                tokens += [g.token for g in loop.next()[1] if g.uid == uid]
            out.append(tokens)
        return out, loop.spec_counters

    plain, _ = run(None)
    full, full_counts = run(Speculation(drafts=2))
    try:
        model.set_draft_vocab(ids)
        drafted = model.draft_tokens(hidden).tolist()[0]
        assert set(drafted) <= set(ids)
        reduced, reduced_counts = run(Speculation(drafts=2))
    finally:
        model.set_draft_vocab(None)
    assert full == plain and reduced == plain
    assert full_counts.drafts > 0 and reduced_counts.drafts > 0 and reduced_counts.accepted_tokens > 0
    assert mx.array_equal(model.draft_tokens(hidden), mx.argmax(model.draft_logits(hidden), axis=-1)).item()


@pytest.mark.parametrize("plan", ["auto", "packed"])
def test_a_verify_step_computes_what_decode_steps_compute(embedded_path, plan):
    """Bit for bit: each position of a step of four tokens (as a verify step runs it) has the
    logits a one-token decode step gives it, on the served plan (mostly dense: BLAS products
    run position by position) and on the packed kernels (whose rows never depend on how many
    share a call). Greedy outputs with drafting are then the same tokens however close a tie."""
    import mlx.core as mx

    from mixbit.models.forward import DECODE
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    lm = load(resolve(str(embedded_path)), cpu_quantized=plan, cpu_activations="float32")
    model = lm.model
    prompt = lm.tokenizer.encode("The weather in Oslo is", add_special_tokens=False)
    step = [11, 12, 13, 14]

    def prefilled():
        cache = model.make_cache()
        model(mx.array([prompt]), cache=cache)
        return cache

    cache = prefilled()
    one_by_one = mx.concatenate([model(mx.array([[t]]), cache=cache, phase=DECODE) for t in step], axis=1)
    verified = model(mx.array([step]), cache=prefilled(), phase=DECODE, states={})
    assert mx.array_equal(one_by_one, verified).item()


def test_auto_decides_once_per_variant_and_machine(loaded_tiny, tmp_path):
    """generation.mtp = "auto": the decode loop's steps timed without and with drafts, the
    decision kept beside the CPU plan and read back by later starts (so they decide alike), and
    the decision follows from the two medians (whichever way the timing went on this machine)."""
    from mixbit.server.speculative import EXPECTED_ACCEPTANCE, crossover, tokens_per_step

    path = tmp_path / "plan-mtp.json"
    first = crossover(loaded_tiny.model, 2, path)
    assert first["source"] == "measured" and path.is_file()
    assert first["plain_step_ms"] > 0 and first["drafting_step_ms"] > 0
    ratio = first["drafting_step_ms"] / first["plain_step_ms"]
    assert first["pays"] == (tokens_per_step(EXPECTED_ACCEPTANCE, 2) > ratio)
    again = crossover(loaded_tiny.model, 2, path)
    assert again["source"] == "cached" and {k: v for k, v in again.items() if k != "source"} == \
        {k: v for k, v in first.items() if k != "source"}
    assert crossover(loaded_tiny.model, 1, path)["source"] == "measured", "another draft count is measured anew"
    assert crossover(loaded_tiny.model, 1, path, vocab=512)["source"] == "measured", "so is another draft vocabulary"



def test_a_verify_step_never_takes_the_prompt_path(embedded_path):
    """A plan whose packed projections take the prompt path from 2 rows (a measured plan at a
    real shape does from 4): a verify step still runs each position on the decode kernels, bit
    for bit a decode step."""
    import mlx.core as mx

    from mixbit.models.forward import DECODE
    from mixbit.models.forward.layers import is_packed
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    lm = load(resolve(str(embedded_path)), cpu_quantized="packed", cpu_activations="int16")
    model = lm.model
    packed = [m for _, m in model.named_modules() if is_packed(m)]
    assert packed
    for m in packed:
        m.prompt_from_rows = 2
    prompt = lm.tokenizer.encode("The weather in Oslo is", add_special_tokens=False)
    step = [11, 12, 13, 14]
    caches = [model.make_cache(), model.make_cache()]
    for cache in caches:
        model(mx.array([prompt]), cache=cache)
    one_by_one = mx.concatenate([model(mx.array([[t]]), cache=caches[0], phase=DECODE) for t in step], axis=1)
    verified = model(mx.array([step]), cache=caches[1], phase=DECODE, states={})
    assert mx.array_equal(one_by_one, verified).item()


def test_the_head_catches_up_after_a_batch(loaded_tiny):
    """Two sequences decode together (no drafts), then one goes on alone and drafts: the head
    takes the pairs of the batched steps in one call first, so its cache holds every position
    the model's does (in the finished sequences' caches too), drafts are accepted, and the
    tokens are those without drafting."""
    from mixbit.models.chat.template import render_chat
    from mixbit.server.batching import BatchLoop
    from mixbit.server.speculative import SpecCounters, Speculation

    lm, model = loaded_tiny, loaded_tiny.model
    prompts = [lm.tokenizer.encode(render_chat(lm.tokenizer, m, enable_thinking=False), add_special_tokens=False)
               for m in (JOKE, [{"role": "user", "content": "Write a short poem about the sea."}])]
    full = next(i for i, layer in enumerate(model.layers) if not layer.is_linear)

    def run(spec):
        loop = BatchLoop(model, stop_tokens=[], speculate=spec, counters=SpecCounters())
        uids = [loop.insert([prompts[0]], 12), loop.insert([prompts[1]], 40)]
        out, caches = {u: [] for u in uids}, {}
        while len(loop):
            for g in loop.next()[1]:
                out[g.uid].append(g.token)
                if g.finish_reason:
                    caches[g.uid] = g.prompt_cache
        return [out[u] for u in uids], [caches[u] for u in uids], loop.spec_counters

    plain, _, _ = run(None)
    tokens, caches, counters = run(Speculation(drafts=2))
    assert tokens == plain
    assert counters.drafts > 0 and counters.accepted_tokens > 0, "the sequence left alone drafted"
    for cache in caches:
        assert model.has_mtp_cache(cache)
        assert cache[len(model.layers)].offset == cache[full].offset, "the head saw every position"
