"""Per-sequence sampling: seeded samplers and logits processors that share one batch.

mlx-lm's `BatchGenerator` calls each sequence's own sampler on its row of log-probabilities, so a
request with a seed joins the batch like any other: its sampler draws from its own random key.
Filters (top-p, min-p, top-k) and penalties are mlx-lm's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, make_logits_processors)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(p: SamplingParams, draw_index: int = 0):
    """A sampler for one sequence; with a seed, the same seed gives the same tokens."""
    if p.temperature == 0:
        return greedy
    # MLX keys take 0..2**64-1: negative (int64) seeds and seed + n wrap around
    key = [mx.random.key((p.seed + draw_index) % 2**64)] if p.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        x = logprobs
        if 0 < p.top_p < 1.0:
            x = apply_top_p(x, p.top_p)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        if p.top_k > 0:
            x = apply_top_k(x, p.top_k)
        x = x * (1.0 / p.temperature)
        if key is None:
            return mx.random.categorical(x)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(x, key=sub)

    return sample


def make_processors(p: SamplingParams) -> list:
    # OpenAI's presence/frequency penalties apply to everything generated so far; mlx-lm's take a
    # context window, so give them the whole completion budget.
    window = max(p.max_tokens, 20)
    return make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=p.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=window,
    )
