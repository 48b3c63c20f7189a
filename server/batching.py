"""mixbit's decode loop: continuous batching over its own Qwen3.5 forward.

Sequences wait, then prefill together in rounds (at most `prefill_tokens` prompt tokens per
round across the prompts being prefilled, at least `min_prefill_step` each), then decode in one
batch; a prompt may come in segments, and the loop reports each segment's end so the engine can
keep the cache there (prefix reuse). Caches are mlx-lm's, through their public batching methods
(merge, extend, filter, extract, prepare, finalize). A decode step computes the logits of the
batch (the DECODE phase), applies each sequence's logits processors, normalises them on the
kernels (MLX's Linux build takes 9 ms a row of Qwen3.5's 248,320 logits, the kernel ~0.3 ms)
and samples with each sequence's sampler (one batched call where they share one). As in
mlx-lm's BatchGenerator, the next step is started (async_eval) before the current tokens are
handed out, so the caller's per-token work overlaps the model's.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import TokenBuffer

from ..models import kernels
from ..models.forward import DECODE, PREFILL
from .sampling import greedy
from .speculative import SpecCounters, Speculation, accept

MIN_PREFILL_STEP = 16  # prompt tokens per prompt and round, however many prompts share it
CLEAR_EVERY = 512  # decode steps between returns of MLX's buffer cache (as mlx-lm does)


@dataclass
class PromptProgress:
    """A prompt advanced in this step: `end_of_segment` when a segment is done (its cache may be
    kept), `end_of_prompt` when the whole prompt is and the sequence starts decoding."""
    uid: int
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class Generated:
    uid: int
    token: int
    logprobs: mx.array  # the normalised logits the token was drawn from
    finish_reason: str | None  # "stop" (a stop token), "length", or None
    prompt_cache: list | None = None  # with a finish: the sequence's cache, its tokens below
    all_tokens: list[int] | None = None


@dataclass
class _Seq:
    uid: int
    segments: list[list[int]]
    max_tokens: int
    cache: list
    tokens: list[int]  # the tokens in its cache
    sampler: Callable
    processors: tuple
    generated: int = 0
    draws: object = None  # the sampler the speculative step draws through (None: not sampled)
    lag: tuple | None = None  # (kept drafts, the hidden states before them) the MTP head owes
    follow: list = field(default_factory=list)  # (token, hidden state) of batched steps it owes


def _merge(caches: list[list]) -> list:
    return [layer[0].merge(list(layer)) for layer in zip(*caches)] if caches else []


def _extend(a: list, b: list) -> list:
    if not a:
        return b
    for ca, cb in zip(a, b):
        ca.extend(cb)
    return a


def _filter(cache: list, keep: list[int]) -> list:
    if not keep:
        return []
    for c in cache:
        c.filter(keep)
    return cache


class BatchLoop:
    def __init__(self, model, *, stop_tokens, max_batch: int = 16, prefill_batch: int = 8,
                 prefill_tokens: int = 512, min_prefill_step: int = MIN_PREFILL_STEP,
                 speculate: Speculation | None = None, counters: SpecCounters | None = None,
                 replay: Callable | None = None):
        self.model = model
        # drafting with the model's MTP head (server/speculative.py): every sequence's cache
        # then carries the head's caches, kept in step by every prefill round and decode step
        self.spec = speculate if speculate is not None and speculate.drafts > 0 \
            and getattr(model, "mtp", None) is not None else None
        self.spec_counters = counters if counters is not None else SpecCounters()
        # benchmarks only (tests/bench/mtp_bench.py, never served): replay(uid, generated, k)
        # replaces the head's drafts after it ran, to measure the machinery at a set acceptance
        # on random weights
        self.replay = replay
        self.stop_tokens = set(stop_tokens)
        self.max_batch = max_batch
        self.prefill_batch = min(prefill_batch, max_batch)
        self.prefill_tokens = prefill_tokens
        self.min_prefill_step = min_prefill_step
        self._uids = 0
        self._pending: deque[_Seq] = deque()
        # the prompt batch: sequences being prefilled together, and their batched cache
        self._prompting: list[_Seq] = []
        self._pcache: list = []
        # the decode batch, its batched cache, the step in flight and the processors' contexts
        self._decoding: list[_Seq] = []
        self._dcache: list = []
        self._next_tokens: mx.array | None = None
        self._next_logprobs: list = []
        self._contexts: list[TokenBuffer] = []
        self._steps = 0

    def __len__(self) -> int:
        return len(self._pending) + len(self._prompting) + len(self._decoding)

    # ------------------------------------------------------------------ membership
    def insert(self, segments: list[list[int]], max_tokens: int, cache: list | None = None,
               tokens: list[int] | None = None, sampler: Callable | None = None,
               processors=(), draws=None) -> int:
        """A sequence whose prompt is `segments` (after the `tokens` already in `cache`), to
        generate at most `max_tokens`. `draws`: the sampling.Sampler behind a wrapped `sampler`
        (a sampled sequence speculates only with it). Returns its uid."""
        segments = [list(s) for s in segments if s]
        if not segments:
            raise ValueError("empty prompt")
        if max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        if len(segments[-1]) != 1:  # the last token starts decoding: a segment of its own
            segments.append(segments[-1][-1:])
            segments[-2] = segments[-2][:-1]
        uid = self._uids
        self._uids += 1
        if cache is None:
            cache = self.model.make_cache(mtp=True) if self.spec else self.model.make_cache()
        elif self.spec and not self.model.has_mtp_cache(cache):
            # a cache kept without the head's: the head drafts from what it sees from here on
            cache = list(cache) + self.model.make_cache(mtp=True)[len(cache):]
        self._pending.append(_Seq(uid, segments, max_tokens, cache, list(tokens or []), sampler or greedy,
                                  tuple(processors or ()), draws=draws))
        return uid

    @property
    def speculating(self) -> bool:
        """Whether the next step drafts (one sequence decoding, within the batch limit)."""
        return self.spec is not None and len(self._decoding) == 1

    def remove(self, uids) -> None:
        gone = set(uids)
        self._pending = deque(s for s in self._pending if s.uid not in gone)
        keep = [i for i, s in enumerate(self._prompting) if s.uid not in gone]
        if len(keep) < len(self._prompting):
            self._prompting = [self._prompting[i] for i in keep]
            self._pcache = _filter(self._pcache, keep)
        keep = [i for i, s in enumerate(self._decoding) if s.uid not in gone]
        if len(keep) < len(self._decoding):
            self._keep_decoding(keep)

    def extract_cache(self, uids) -> dict[int, tuple[list, list[int]]]:
        """{uid: (its cache, the tokens in it)}, for sequences waiting or being prefilled."""
        want = set(uids)
        out = {s.uid: (s.cache, s.tokens) for s in self._pending if s.uid in want}
        for i, s in enumerate(self._prompting):
            if s.uid in want:
                out[s.uid] = ([c.extract(i) for c in self._pcache], list(s.tokens))
        return out

    # ------------------------------------------------------------------ steps
    def next(self) -> tuple[list[PromptProgress], list[Generated]]:
        """One step: a decode step of the running batch, then (while it has room) a prefill
        round of the waiting prompts."""
        if self.speculating:
            generated = self._speculate()
        else:
            generated = self._decode() if self._decoding else []
        if len(self._decoding) >= self.max_batch:
            return [], generated
        n = min(self.prefill_batch - len(self._prompting), self.max_batch - len(self._decoding), len(self._pending))
        if n > 0:
            joining = [self._pending.popleft() for _ in range(n)]
            self._prompting += joining
            self._pcache = _extend(self._pcache, _merge([s.cache for s in joining]))
            for s in joining:
                s.cache = None  # in the batch now
        progress = self._start_decoding()
        if self._prompting:
            progress += self._prefill_round()
        return progress, generated

    def _start_decoding(self) -> list[PromptProgress]:
        """Prompts with only their last token left start decoding: their first step runs now."""
        ready = [i for i, s in enumerate(self._prompting) if len(s.segments) == 1 and len(s.segments[0]) == 1]
        if not ready:
            return []
        rest = [i for i in range(len(self._prompting)) if i not in ready]
        cache = _filter(copy.deepcopy(self._pcache), ready) if rest else self._pcache
        seqs = [self._prompting[i] for i in ready]
        self._prompting = [self._prompting[i] for i in rest]
        self._pcache = _filter(self._pcache, rest) if rest else []
        inputs = mx.array([s.segments[0][0] for s in seqs])
        for s in seqs:
            s.segments = []
        contexts = [TokenBuffer(s.tokens) for s in seqs]
        tokens, logprobs, ctx = self._forward(seqs, cache, contexts, inputs)
        mx.async_eval(tokens, logprobs, ctx, self._mtp_state(cache))
        for s, t in zip(seqs, inputs.tolist()):
            s.tokens.append(t)
        # join the decode batch: the newcomers' first tokens come out of the next step
        if self.spec and len(self._decoding) == 1:
            self._settle(self._decoding[0], self._dcache)
        self._decoding += seqs
        self._dcache = _extend(self._dcache, cache)
        self._contexts += contexts
        self._next_tokens = tokens if self._next_tokens is None else mx.concatenate([self._next_tokens, tokens])
        self._next_logprobs += logprobs
        return [PromptProgress(s.uid, True, True) for s in seqs]

    def _prefill_round(self) -> list[PromptProgress]:
        step = max(self.min_prefill_step, self.prefill_tokens // len(self._prompting))
        chunks, progress = [], []
        for s in self._prompting:
            n = min(len(s.segments[0]), step)
            chunks.append(s.segments[0][:n])
            s.segments[0] = s.segments[0][n:]
            end = not s.segments[0]
            if end:
                s.segments.pop(0)
            s.tokens += chunks[-1]
            progress.append(PromptProgress(s.uid, end, False))
        lengths = [len(c) for c in chunks]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding):
            for c in self._pcache:
                c.prepare(lengths=lengths, right_padding=padding)
            inputs = mx.array([c + [0] * (longest - len(c)) for c in chunks])
        else:
            inputs = mx.array(chunks)
        if self.spec:  # the logits are never evaluated
            _, hidden = self.model(inputs, cache=self._pcache, phase=PREFILL, return_hidden=True)
            self.model.mtp_follow(inputs, hidden, self._pcache, PREFILL,
                                  lengths=lengths if max(padding) else None)
        else:
            self.model(inputs, cache=self._pcache, phase=PREFILL)
        if max(padding):
            for c in self._pcache:
                c.finalize()
        mx.eval([c.state for c in self._pcache])
        mx.clear_cache()
        return progress

    def _forward(self, seqs, cache, contexts, inputs):
        """Logits of one position per sequence -> processors -> normalised -> sampled."""
        if self.spec:
            logits, hidden = self.model(inputs[:, None], cache=cache, phase=DECODE, return_hidden=True)
            if len(seqs) == 1:
                self.model.mtp_follow(inputs[:, None], hidden, cache, DECODE)
            else:  # a batch does not draft: each sequence's pairs wait for it to decode alone or finish
                for e, s in enumerate(seqs):
                    s.follow.append((inputs[e:e + 1], hidden[e:e + 1]))
            logits = logits[:, -1, :]
        else:
            logits = self.model(inputs[:, None], cache=cache, phase=DECODE)[:, -1, :]
        used = []
        if any(s.processors for s in seqs):
            rows = []
            for e, s in enumerate(seqs):
                row = logits[e:e + 1]
                if s.processors:
                    context = contexts[e].update_and_fetch(inputs[e:e + 1])
                    used.append(context)
                    for p in s.processors:
                        row = p(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - kernels.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [s.sampler for s in seqs]
        if all(f is samplers[0] for f in samplers):
            tokens = samplers[0](logprobs)
        else:
            tokens = mx.concatenate([f(logprobs[e:e + 1]) for e, f in enumerate(samplers)], axis=0)
        return tokens, list(logprobs), used

    def _decode(self) -> list[Generated]:
        current, current_logprobs = self._next_tokens, self._next_logprobs
        self._next_tokens, self._next_logprobs, ctx = self._forward(self._decoding, self._dcache,
                                                                    self._contexts, current)
        mx.async_eval(self._next_tokens, self._next_logprobs, ctx, self._mtp_state(self._dcache))
        mx.eval(current, current_logprobs)
        self._steps += 1
        if self._steps % CLEAR_EVERY == 0:
            mx.clear_cache()
        out, keep = [], []
        for i, (s, token) in enumerate(zip(self._decoding, current.tolist())):
            out.append(self._emit(i, token, current_logprobs[i]))
            if out[-1].finish_reason is None:
                keep.append(i)
        if len(keep) < len(self._decoding):
            self._keep_decoding(keep)
        return out

    def _emit(self, i: int, token: int, logprobs) -> Generated:
        """Decode-batch row i's next token: appended to its tokens (the cache holds it), with
        its finish, if any (then its cache goes with it)."""
        s = self._decoding[i]
        s.tokens.append(token)
        s.generated += 1
        reason = "stop" if token in self.stop_tokens else "length" if s.generated >= s.max_tokens else None
        if reason is None:
            return Generated(s.uid, token, logprobs, None)
        cache = [c.extract(i) for c in self._dcache]
        self._settle(s, cache)  # the head's cache complete in the prefix cache too
        return Generated(s.uid, token, logprobs, reason, cache, list(s.tokens))

    def _mtp_state(self, cache) -> list:
        return self.model.mtp_state(cache) if self.spec and cache else []

    def _speculate(self) -> list[Generated]:
        """A speculative step of the one decoding sequence (server/speculative.py): hands out the
        token chosen last step, drafts after it with the MTP head, verifies it and the drafts in
        one forward, keeps what the model agrees with and rolls the caches back to there. The
        head takes the pairs of the drafts kept (`lag`) with its next step's first draft."""
        s, cache, context = self._decoding[0], self._dcache, self._contexts[0]
        current, current_logprobs = self._next_tokens, self._next_logprobs
        mx.eval(current, current_logprobs)
        first = current.item()
        out = [self._emit(0, first, current_logprobs[0])]
        if out[-1].finish_reason is not None:
            self._keep_decoding([])
            return out
        # drafts beyond what the sequence may still generate are never kept: k + 1 tokens at most
        k = min(self.spec.drafts, s.max_tokens - s.generated - 1)
        sampled = s.sampler is not greedy
        if k <= 0 or (sampled and s.draws is None):
            self._settle(s, cache)
            self._next_tokens, self._next_logprobs, ctx = self._forward([s], cache, self._contexts, current)
            mx.async_eval(self._next_tokens, self._next_logprobs, ctx, self._mtp_state(cache))
            return out
        model, n = self.model, len(self.model.layers)
        self._settle(s, cache)  # the pairs it owes (kept drafts, batched steps) first
        pending = cache[-1][0]
        if pending is None:
            pending = mx.zeros((1, 1, model.language_model.args.hidden_size))
        hidden = model.mtp_pairs(mx.array([[first]]), pending, cache, DECODE)
        drafts = []
        for j in range(k):  # the head's own hidden state carries each draft to the next
            token = model.draft_tokens(hidden[:, -1:], DECODE)
            drafts.append(token)
            if j < k - 1:
                hidden = model.mtp_pairs(token, hidden, cache, DECODE)
        drafted = mx.concatenate(drafts, axis=1)
        if k > 1:
            for c in cache[n:-1]:  # the chained drafts' pairs: the verified ones replace them
                c.trim(k - 1)
        # the drafts stay in the graph: the head and the verify forward run in one evaluation
        inputs = mx.concatenate([mx.array([[first]]), drafted], axis=1)
        if self.replay is not None:  # the head's drafts are still computed (paid for), then replaced
            inputs = mx.array([[first] + self.replay(s.uid, s.generated, k)])
        states: dict = {}
        logits, hidden = model(inputs, cache=cache, phase=DECODE, return_hidden=True, states=states)
        fast = not s.processors and not sampled
        chosen = mx.argmax(logits[0], axis=-1) if fast else logits
        mx.eval(inputs, chosen, drafted)
        drafts = inputs[0, 1:].tolist()
        a, bonus, rows = accept(logits[0], drafts, sampler=s.draws if sampled else greedy,
                                processors=s.processors, context=context, first=first,
                                stop_tokens=self.stop_tokens, chosen=chosen.tolist() if fast else None)
        self.spec_counters.add(k, a)
        model.rollback(cache, states, kept=a + 1, verified=k + 1)
        cache[-1][0] = hidden[:, a:a + 1]
        if a:
            s.lag = (drafts[:a], hidden[:, :a])
        for j in range(a):
            out.append(self._emit(0, drafts[j], rows[j]))
            if out[-1].finish_reason is not None:
                self._keep_decoding([])
                return out
        self._next_tokens, self._next_logprobs = mx.array([bonus]), [rows[a]]
        mx.async_eval([c.state for c in cache])
        return out

    def _settle(self, s: _Seq, cache: list) -> None:
        """The head takes the pairs of a sequence it has not seen yet, into the sequence's own
        (one-row) `cache`: its kept drafts, or the steps it decoded in a batch, in one call
        (before it drafts, joins a batch, or its cache leaves the loop)."""
        if s.lag is not None:
            tokens, prev = s.lag
            s.lag = None
            self.model.mtp_remember(mx.array([tokens]), prev, cache, DECODE)
        if s.follow:
            tokens = mx.concatenate([t for t, _ in s.follow])[None]
            hidden = mx.concatenate([h for _, h in s.follow], axis=1)
            s.follow = []
            self.model.mtp_follow(tokens, hidden, cache, DECODE)

    def _keep_decoding(self, keep: list[int]) -> None:
        self._decoding = [self._decoding[i] for i in keep]
        self._dcache = _filter(self._dcache, keep)
        self._contexts = [self._contexts[i] for i in keep]
        self._next_logprobs = [self._next_logprobs[i] for i in keep]
        self._next_tokens = self._next_tokens[mx.array(keep)] if keep else None
