"""Top-p over Qwen3.5's 248,320-token vocabulary: mixbit's candidate path keeps exactly the tokens
mlx-lm's full sort keeps, for peaked (trained-model-like) and flat (fallback) distributions."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

from mixbit.server import sampling
from mixbit.server.sampling import SamplingParams, make_sampler, top_p_filter

V = 248320


def logprobs(scale: float, rows: int = 1, seed: int = 0) -> mx.array:
    x = mx.random.normal((rows, V), key=mx.random.key(seed)) * scale
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("scale", [0.5, 2.0, 4.0, 8.0, 30.0])
@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_what_mlx_lm_keeps(scale, top_p):
    lp = logprobs(scale, rows=2, seed=int(scale * 10))
    ours, theirs = top_p_filter(lp, top_p), apply_top_p(lp, top_p)
    kept_ours = np.isfinite(np.array(ours))
    kept_theirs = np.isfinite(np.array(theirs))
    assert (kept_ours == kept_theirs).all()
    assert kept_ours.sum(axis=-1).min() >= 1
    assert np.array_equal(np.where(kept_ours, np.array(ours), 0), np.where(kept_theirs, np.array(theirs), 0))


def test_fast_path_for_peaked_rows_and_fallback_for_flat_ones(monkeypatch):
    calls = []
    real = sampling.apply_top_p
    monkeypatch.setattr(sampling, "apply_top_p", lambda x, p: calls.append(p) or real(x, p))
    top_p_filter(logprobs(8.0), 0.9)  # a nucleus of a few tokens: among the 1024 candidates
    assert calls == []
    top_p_filter(logprobs(0.5), 0.9)  # near uniform: the nucleus is most of the vocabulary
    assert calls == [0.9]


def test_seeded_sampling_draws_what_the_full_sort_draws():
    lp = logprobs(4.0, seed=3)
    params = SamplingParams(temperature=0.7, top_p=0.8, seed=1234)
    sampler = make_sampler(params)
    key = mx.random.key(1234)
    for _ in range(20):
        key, sub = mx.random.split(key)
        expected = mx.random.categorical(apply_top_p(lp, 0.8) * (1 / 0.7), key=sub)
        assert sampler(lp).item() == expected.item()
