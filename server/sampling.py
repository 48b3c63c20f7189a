"""Per-sequence sampling: seeded samplers and logits processors that share one batch.

mlx-lm's `BatchGenerator` calls each sequence's own sampler on its row of log-probabilities, so a
request with a seed joins the batch like any other: its sampler draws from its own random key.
Filters (min-p, top-k) and penalties are mlx-lm's own; top-p is mlx-lm's rule computed over the
largest `TOP_P_CANDIDATES` log-probabilities when they hold the nucleus (they do for a trained
model), since sorting Qwen3.5's 248,320 entries for every token took 24.5 ms of a ~83 ms decode
step at the 0.8B shape (tests/bench/step_profile.py); the full sort remains the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, make_logits_processors)

TOP_P_CANDIDATES = 1024


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
    # a thinking budget: after this many generated tokens still inside <think>, `think_end`
    # (the ids of "</think>") is forced, one token at a time (0: no budget)
    think_budget: int = 0
    think_end: tuple[int, ...] = ()


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def top_p_filter(logprobs: mx.array, top_p: float, candidates: int = TOP_P_CANDIDATES) -> mx.array:
    """mlx-lm's `apply_top_p` (keep the most likely tokens until their mass reaches top_p, ties at
    the threshold kept), computed over the `candidates` largest entries of each row when the
    nucleus ends among them, else by mlx-lm's full sort."""
    n = logprobs.shape[-1]
    if n <= candidates:
        return apply_top_p(logprobs, top_p)
    top = mx.sort(mx.topk(logprobs, candidates, axis=-1), axis=-1)  # ascending, as mlx-lm sorts
    probs = mx.exp(top.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mx.exp(logprobs.astype(mx.float32)).sum(axis=-1, keepdims=True)
    dropped = mass_above >= top_p * total
    # the nucleus ends inside the candidates when the smallest of them is dropped: then so is
    # everything outside them (no larger), and the rule's threshold is among the candidates
    if not bool(dropped[..., 0].all().item()):
        return apply_top_p(logprobs, top_p)
    threshold = mx.take_along_axis(top, dropped.sum(axis=-1, keepdims=True), axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


class Sampler:
    """One sequence's sampler: `sampler(logprobs)` draws a token from the distribution its
    settings make of the row (`logits`: top-p, min-p, top-k, then the temperature), with its own
    random key when the request has a seed. Speculative decoding draws through the same key
    (`uniform`, `draw`), so a seeded request repeats itself."""

    def __init__(self, p: SamplingParams, draw_index: int = 0):
        self.p = p
        # MLX keys take 0..2**64-1: negative (int64) seeds and seed + n wrap around
        self.key = mx.random.key((p.seed + draw_index) % 2**64) if p.seed is not None else None

    def logits(self, logprobs: mx.array) -> mx.array:
        """The row's logits of the distribution this sampler draws from (up to a constant)."""
        p, x = self.p, logprobs
        if 0 < p.top_p < 1.0:
            x = top_p_filter(x, p.top_p)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        if p.top_k > 0:
            x = apply_top_k(x, p.top_k)
        return x * (1.0 / p.temperature)

    def _subkey(self):
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def draw(self, logits: mx.array) -> mx.array:
        return mx.random.categorical(logits, key=self._subkey())

    def uniform(self) -> mx.array:
        return mx.random.uniform(key=self._subkey())

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.draw(self.logits(logprobs))


def make_sampler(p: SamplingParams, draw_index: int = 0):
    """A sampler for one sequence (`greedy` at temperature 0); with a seed, the same seed gives
    the same tokens."""
    if p.temperature == 0:
        return greedy
    return Sampler(p, draw_index)


def think_budget_processor(budget: int, end: tuple[int, ...]):
    """Ends the thinking after `budget` generated tokens: forces the tokens of `end` (unless the
    model closed its thinking itself). mlx-lm calls a processor once per generated token, with
    the sequence's tokens so far."""
    state = {"steps": 0, "forced": 0, "closed": False}

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        steps = state["steps"]
        state["steps"] += 1
        if state["closed"]:
            return logits
        if steps and tokens.size and int(tokens.reshape(-1)[-1].item()) == end[-1] and not state["forced"]:
            state["closed"] = True  # the model ended its thinking within the budget
            return logits
        if steps < budget:
            return logits
        token = end[state["forced"]]
        state["forced"] += 1
        state["closed"] = state["forced"] == len(end)
        ids = mx.arange(logits.shape[-1])
        return mx.broadcast_to(mx.where(ids == token, mx.array(0, logits.dtype),
                                        mx.array(-float("inf"), logits.dtype)), logits.shape)

    return process


def make_processors(p: SamplingParams) -> list:
    # OpenAI's presence/frequency penalties apply to everything generated so far; mlx-lm's take a
    # context window, so give them the whole completion budget.
    window = max(p.max_tokens, 20)
    budget = [think_budget_processor(p.think_budget, p.think_end)] if p.think_budget and p.think_end else []
    return budget + make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=p.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=window,
    )
