"""Self-speculative decoding with the model's own MTP head: the settings, the acceptance rule and
the counters.

A speculative step of a sequence (server/batching.py runs it): the MTP head drafts k tokens
after the token the model last chose (greedily, each from the head's own hidden state); the
model verifies that token and the k drafts in one forward of k + 1 positions; the longest run of
drafts the model itself would have produced is kept, plus the model's own token at the first
position that disagrees (or after the last draft), so every step yields 1 to k + 1 tokens. The
caches roll back to the last kept position: attention caches are trimmed, GatedDeltaNet's conv
and recurrent states are set to the ones the forward kept after that position (no recompute),
and the head's own cache follows the model's (models/forward/qwen3_5.Model.mtp_follow).

What a sequence gets is exactly what it gets without drafting: each position's logits go
through the sequence's own logits processors (grammar, penalties, bias) with the tokens before
it, in order, and stop at the first rejection, so a processor only ever sees accepted tokens;
at temperature 0 a draft is kept when it is the argmax; when sampling, a draft d is kept with
probability p(d) under the sequence's own sampling distribution p (top-p/top-k/min-p and the
temperature applied), and on rejection the token is drawn from p with d removed, which leaves
every position distributed exactly as p (a one-hot draft in the standard rejection rule).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..models import kernels
from .sampling import greedy


@dataclass
class Speculation:
    """`generation.mtp`: draft `drafts` tokens per step while one sequence decodes (a batch of
    several decodes plainly: their acceptance differs per row, and a batched step already reads
    the weights once for all of them), over the `vocab` most frequent tokens (0: all)."""
    drafts: int = 1
    vocab: int = 0


# `generation.mtp = "auto"` drafts where a step that drafts pays at this acceptance (llama.cpp's
# author measured 0.79 for Qwen3.5's own head; the embedded model's head holds 0.81 teacher-forced)
EXPECTED_ACCEPTANCE = 0.75
CROSSOVER_VERSION = 1


def tokens_per_step(acceptance: float, drafts: int) -> float:
    """Expected tokens a step yields with `drafts` drafts, each kept with `acceptance` after a
    kept one (1 + a + a^2 + ... + a^k)."""
    return sum(acceptance ** j for j in range(drafts + 1))


def measure_crossover(model, drafts: int, context: int = 64, steps: int = 12) -> dict:
    """Times, on this machine and model, the decode loop's steps of one sequence (a synthetic
    one of `context` tokens) without drafting and with `drafts` drafts a step: each step as the
    engine runs it (forward, logprobs, sampling, the loop's own work). Returns both medians, the
    acceptance at which drafting breaks even, and whether it pays at EXPECTED_ACCEPTANCE."""
    import statistics
    import time

    from .batching import BatchLoop

    prompt = [(7 * i + 3) % 1000 + 10 for i in range(context)]

    def median_ms(spec) -> float:
        loop = BatchLoop(model, stop_tokens=[], speculate=spec, max_batch=1)
        loop.insert([prompt], (steps + 4) * (drafts + 1))
        for _ in range(3):  # the prompt, then warm-up steps
            loop.next()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loop.next()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    plain_ms, spec_ms = median_ms(None), median_ms(Speculation(drafts=drafts))
    ratio = spec_ms / plain_ms
    even = next((a / 100 for a in range(0, 101) if tokens_per_step(a / 100, drafts) >= ratio), None)
    return {"version": CROSSOVER_VERSION, "drafts": drafts, "plain_step_ms": round(plain_ms, 2),
            "drafting_step_ms": round(spec_ms, 2), "break_even_acceptance": even,
            "expected_acceptance": EXPECTED_ACCEPTANCE,
            "pays": tokens_per_step(EXPECTED_ACCEPTANCE, drafts) > ratio}


def crossover(model, drafts: int, path: Path | None, vocab: int = 0) -> dict:
    """`measure_crossover`, kept at `path` (beside the variant's CPU plan) and read back at every
    later start with the same drafts and draft vocabulary (`vocab`, as the settings say), so two
    starts of a variant on one machine decide alike."""
    if path is not None and path.is_file():
        try:
            found = json.loads(path.read_text())
            if (found.get("version"), found.get("drafts"), found.get("draft_vocab")) == \
                    (CROSSOVER_VERSION, drafts, vocab):
                return {**found, "source": "cached"}
        except (OSError, ValueError):
            pass
    found = {**measure_crossover(model, drafts), "draft_vocab": vocab}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".mtp-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(found, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass
    return {**found, "source": "measured"}


DRAFT_VOCAB_DOCUMENTS = 400  # built-in calibration documents counted for the draft vocabulary


def draft_vocabulary(tokenizer, size: int, documents: int = DRAFT_VOCAB_DOCUMENTS) -> list[int] | None:
    """The `size` tokens most frequent in mixbit's built-in calibration text (chat, code and
    tool calls, rendered through the model's chat template), plus every special token: the
    vocabulary the MTP head drafts from (FR-Spec). None when that is the whole vocabulary."""
    from collections import Counter

    from ..quant.calibration import builtin_documents, render

    vocab = len(tokenizer.get_vocab())
    if size <= 0 or size >= vocab:
        return None
    counts: Counter = Counter()
    for doc in builtin_documents(documents):
        counts.update(tokenizer.encode(render(tokenizer, doc), add_special_tokens=False))
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
    ids = set(sorted(special)[:size])
    for t, _ in counts.most_common():
        if len(ids) >= size:
            break
        ids.add(t)
    rest = iter(range(vocab))  # short of `size`: the lowest ids (byte-level pieces, early merges)
    while len(ids) < size:
        ids.add(next(rest))
    return sorted(ids)


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters: steps that drafted, tokens drafted, drafts kept,
    and kept drafts by position (position 0 = the first draft of a step)."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accepted_per_position) < drafted:
            self.accepted_per_position.append(0)
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")


def normalise(logits: mx.array) -> mx.array:
    return logits - kernels.logsumexp(logits, axis=-1, keepdims=True)


def accept(rows: mx.array, drafts: list[int], *, sampler, processors=(), context=None,
           first: int | None = None, stop_tokens=frozenset(),
           chosen: list[int] | None = None) -> tuple[int, int | None, list[mx.array]]:
    """The verify step's verdict for one sequence: `rows` [k + 1, V] are the model's logits at
    the token it chose last (`first`) and after each of the k `drafts`. Returns (accepted
    drafts a, the model's own token after them (None when an accepted draft is a stop token:
    the sequence ends there), the normalised rows the a drafts and that token were taken from).

    `sampler`: server/sampling's `greedy` or a `Sampler`; `processors` see, at each position,
    `context` (a TokenBuffer of the sequence's tokens) with the tokens before that position.
    `chosen`: the rows' argmax, where the caller evaluated it with the forward (greedy, no
    processors)."""
    k = len(drafts)
    if not processors and sampler is greedy:  # the plain case at once: argmax of every row
        logprobs = normalise(rows)
        if chosen is None:
            chosen = mx.argmax(rows, axis=-1).tolist()
        a = 0
        while a < k and chosen[a] == drafts[a]:
            a += 1
            if drafts[a - 1] in stop_tokens:
                return a, None, [logprobs[j] for j in range(a)]
        return a, chosen[a], [logprobs[j] for j in range(a + 1)]
    kept = []
    previous = first
    for j in range(k + 1):
        row = rows[j:j + 1]
        if processors:
            tokens = context.update_and_fetch(mx.array([previous]))
            for p in processors:
                row = p(tokens, row)
        logprobs = normalise(row)
        kept.append(logprobs[0])
        if j == k:
            return k, int(sampler(logprobs).item()), kept
        d = drafts[j]
        if sampler is greedy:
            token = int(mx.argmax(logprobs, axis=-1).item())
            if token != d:
                return j, token, kept
        else:
            logits = sampler.logits(logprobs)
            probs = mx.softmax(logits.astype(mx.float32), axis=-1)
            if not sampler.uniform().item() < probs[0, d].item():
                masked = mx.where(mx.arange(logits.shape[-1]) == d, -mx.inf, logits)
                return j, int(sampler.draw(masked).item()), kept
        if d in stop_tokens:
            return j + 1, None, kept
        previous = d
    raise AssertionError("unreachable")
