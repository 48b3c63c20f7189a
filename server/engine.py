"""The engine: one thread that owns the model and runs mixbit's continuous-batching decode loop
(batching.py).

Requests join between decode steps, each with its own sampler and logits processors; prompts are
prefilled in chunks so running streams keep flowing; finished and half-finished prompts are kept
in mlx-lm's LRU prompt cache (GatedDeltaNet state included) so an agent loop that resends its
history only prefills what is new. Stop strings are matched on text, across token boundaries, and
held back until they can no longer be the start of a stop string, so they never appear.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import LRUPromptCache

from ..models.blas import release_free_memory

from .batching import BatchLoop
from .sampling import SamplingParams, greedy, make_processors, make_sampler
from .speculative import SpecCounters, Speculation

log = logging.getLogger("mixbit.engine")


@dataclass
class TokenEvent:
    text: str  # newly released text (may be empty while a stop string could still match)
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class FinishEvent:
    reason: str  # stop, length, cancelled, timeout, error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""  # any text still held back, released at the end
    error: str | None = None
    status: int = 500  # with reason "error": 500 this request failed, 503 the engine restarted
    tokens: list[int] = field(default_factory=list)  # every generated id (end-of-turn included)
    stop_sequence: str | None = None  # with reason "stop": the stop string that ended it, if any


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefix_cache_bytes: int = 0
    last_batch_size: int = 0


class StopMatcher:
    """Releases generated text, holding back any tail that could begin a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.released = 0
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        if not self.stops:
            out, self.released = self.text[self.released:], len(self.text)
            return out, False
        longest = max(len(s) for s in self.stops)
        start = max(0, self.released - longest)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i != -1]
        if hits:
            cut, self.matched = min(hits)
            out = self.text[self.released:cut]
            self.released = len(self.text)
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = max(self.released, len(self.text) - hold)
        out, self.released = self.text[self.released:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.released = self.text[self.released:], len(self.text)
        return out


@dataclass
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Any], None]
    extra_processors: list = field(default_factory=list)
    draw_index: int = 0
    uid: int | None = None
    cached: int = 0
    generated: int = 0
    detok: Any = None
    stops: StopMatcher | None = None
    deadline: float | None = None
    cancelled: str | None = None
    tokens: list[int] = field(default_factory=list)
    last_at: float | None = None
    sid: int = 0  # the same id on every rank of a distributed engine
    grammar: str | None = None  # grammar text, so followers build the same constraint
    failure: str | None = None  # set when this sequence's own sampler or processor raised
    done: bool = False  # its FinishEvent was sent
    checkpoints: dict = field(default_factory=dict)  # prompt position -> cache type kept there


class _ChatMarks:
    """Where a chat prompt's cache is worth keeping besides its end. GatedDeltaNet layers carry a
    recurrent state that cannot be rewound, so a later prompt reuses only a state stored at a
    point it shares; the points a conversation's later turns share are:
    - the end of the system block (system prompt and tools: Claude Code's is thousands of tokens,
      and every sub-agent and new conversation starts with it);
    - the start of the thinking tail of the generation prompt (`<think>` ... after
      `<|im_start|>assistant\n`): Qwen3.5's template drops the thinking of earlier turns once a
      new user message follows, so the next turn's prompt diverges there, not at its end.
    mlx_lm.server splits its prompts at the same two points; here they are found in the token
    ids, so every rank of a distributed engine finds the same ones."""

    def __init__(self, tokenizer):
        def one(text: str) -> int | None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None

        self.start = one("<|im_start|>")
        self.think = one("<think>")
        self.system = tokenizer.encode("<|im_start|>system", add_special_tokens=False) \
            if self.start is not None else []

    def checkpoints(self, prompt: list[int]) -> list[tuple[int, str]]:
        """(position, cache type): "system" states are evicted last (mlx-lm's LRUPromptCache)."""
        cuts: list[tuple[int, str]] = []
        n = len(self.system)
        if n and prompt[:n] == self.system:
            nxt = next((i for i in range(n, len(prompt)) if prompt[i] == self.start), None)
            if nxt is not None:
                cuts.append((nxt, "system"))
        if self.think is not None:
            tail = max(0, len(prompt) - 12)
            at = next((i for i in range(len(prompt) - 1, tail - 1, -1) if prompt[i] == self.think), None)
            if at is not None and (not cuts or at > cuts[-1][0]):
                cuts.append((at, "user"))
        return [(c, kind) for c, kind in cuts if 0 < c < len(prompt) - 1]


def _guarded(seq: _Sequence, fn, fallback):
    """Runs a sequence's own sampler or logits processor; an exception marks that sequence as
    failed (the engine ends it after the step) and the batch goes on with `fallback`."""
    def call(*args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            if seq.failure is None:
                log.exception("sequence %d failed in %s", seq.sid, getattr(fn, "__name__", fn))
                seq.failure = f"{type(exc).__name__}: {exc}"
            return fallback(*args)
    return call


def own_buffers(cache: list) -> list:
    """A cache extracted from a batch holds slices of the batch's arrays, and an MLX slice keeps
    its whole parent buffer alive: a GatedDeltaNet state kept for prefix reuse held every row of
    its batch, beyond what the prefix cache counts and bounds (the embedded model, 8 batched
    requests: 29.4 MB held for 7.6 MB counted; the 0.8B shape after a c=8 load: 1,659 MB of MLX
    arrays, 1,027 MB with the copies). Each layer's state is set to copies in buffers of their
    own (through the caches' public `state`); returns `cache`."""
    copies = []

    def own(a):
        if isinstance(a, mx.array):
            copies.append(mx.contiguous(a))
            return copies[-1]
        return a

    for c in cache:
        c.state = tree_map(own, c.state)
    mx.eval(copies)  # the copies exist now; the batch's buffers are no longer referenced
    return cache


def step_buffer_bytes(model, batch: int) -> int:
    """The largest buffers one decode step of `batch` rows allocates, in bytes: the logits, and
    each GatedDeltaNet layer's new recurrent state (float32)."""
    biggest = 0
    for path, m in model.named_modules():
        if all(hasattr(m, a) for a in ("num_v_heads", "head_v_dim", "head_k_dim")):
            biggest = max(biggest, m.num_v_heads * m.head_v_dim * m.head_k_dim)
        elif path.endswith(("lm_head", "embed_tokens")) and "weight" in m:
            biggest = max(biggest, m["weight"].shape[0])  # the vocabulary
    return 4 * batch * biggest


# the logprob reported for a token a grammar, a logit bias or top-k/top-p ruled out (-inf):
# OpenAI's own value for it, since JSON has no infinities
MIN_LOGPROB = -9999.0


def keep_step_buffers(model, batch: int) -> int:
    """Raises MLX's buffer cache limit (process-wide, never lowered) to eight times the
    largest buffers a decode step allocates. MLX's CPU default, 32 MB, is below what one step
    of the 0.8B shape at batch 8 frees and allocates again (an 8 MB state per layer, 8 MB of
    logits): every new state came from a fresh mapping and its page faults, 4.7 ms a layer
    instead of 1.3 ms (ad-hoc timing; 4x, 34 MB, was not enough, 8x is). Returns the limit
    in force."""
    want = max(8 * step_buffer_bytes(model, batch), 32 << 20)
    prev = mx.set_cache_limit(want)
    if prev > want:
        mx.set_cache_limit(prev)
    return max(prev, want)


class Engine:
    def __init__(self, model, tokenizer, *, max_batch: int = 16, prefill_tokens: int = 512,
                 cache_entries: int = 64, cache_bytes: int = 1 << 30, model_key: str = "model",
                 on_token_gap: Callable[[float], None] | None = None, group=None,
                 grammar_engine=None, speculate: Speculation | None = None):
        """With a distributed `group` (size > 1), rank 0 takes requests and every rank runs
        the same batch in lockstep: rank 0 shares each admission and cancellation with the
        others before the step that applies it, so tensor-parallel collectives line up."""
        self.model = model
        # drafting with the model's MTP head (server/speculative.py); not across ranks
        self.speculate = speculate if group is None or group.size() == 1 else None
        self.spec_counters = SpecCounters()
        self.group = group if group is not None and group.size() > 1 else None
        self.rank = self.group.rank() if self.group is not None else 0
        self.grammar_engine = grammar_engine
        self._by_sid: dict[int, _Sequence] = {}
        self._next_sid = 0
        self.on_token_gap = on_token_gap  # inter-token latency observer (metrics)
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.mlx_cache_limit = keep_step_buffers(model, max_batch)
        self.prefill_tokens = prefill_tokens
        self.model_key = model_key
        self.prompt_cache = LRUPromptCache(max_size=cache_entries, max_bytes=cache_bytes)
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[int, _Sequence] = {}
        self._stop = threading.Event()
        self._thread = self._new_thread()
        self._watchdog: threading.Thread | None = None
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self.error: BaseException | None = None
        self.restarts = 0  # times the decode loop or its thread was started again after a failure
        self._taken: list[_Sequence] = []  # admissions being applied by the loop right now
        self._marks = _ChatMarks(tokenizer)

    # ------------------------------------------------------------------ public, any thread
    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="mixbit-engine", daemon=True)

    def start(self, watch_every: float = 0.5) -> None:
        self._thread.start()
        if self.group is None:  # lockstep ranks cannot restart alone: they fail, visibly
            self._watchdog = threading.Thread(target=self._watch, args=(watch_every,),
                                              name="mixbit-engine-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self, every: float) -> None:
        """Starts the engine thread again if it ever dies (the loop restarts itself on ordinary
        exceptions; this covers whatever still ends the thread)."""
        while not self._stop.wait(every):
            if not self._thread.is_alive():
                self.revive()

    def revive(self) -> None:
        if self._stop.is_set() or self._thread.is_alive():
            return
        log.error("the engine thread had stopped (%s); starting it again", self.error)
        self.restarts += 1
        self.prompt_cache = LRUPromptCache(max_size=self.prompt_cache.max_size,
                                           max_bytes=self.prompt_cache.max_bytes)
        self._thread = self._new_thread()
        self.error = None
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether generation can be served now (/ready and /health say so)."""
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt: list[int], params: SamplingParams, emit: Callable[[Any], None],
               extra_processors: list | None = None, draw_index: int = 0,
               timeout_s: float | None = None, grammar=None) -> _Sequence:
        """`grammar`: a compiled grammar (models.grammar) that constrains this sequence."""
        extra = list(extra_processors or [])
        if grammar is not None:
            extra.append(self.grammar_engine.processor(grammar))
        self._next_sid += 1
        seq = _Sequence(prompt=list(prompt), params=params, emit=emit,
                        extra_processors=extra, draw_index=draw_index,
                        deadline=(time.monotonic() + timeout_s) if timeout_s else None,
                        sid=self._next_sid, grammar=grammar.text if grammar is not None else None)
        self.stats.waiting += 1
        self._inbox.put(("add", seq))
        return seq

    def cancel(self, seq: _Sequence, reason: str = "cancelled") -> None:
        self._inbox.put(("cancel", seq, reason))

    # ------------------------------------------------------------------ engine thread
    def run_follower(self) -> None:
        """A rank > 0 of a distributed engine: mirrors rank 0 until it says stop."""
        self._run()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._loop()
                    return
                except Exception as exc:  # noqa: BLE001 - restart the loop, keep serving
                    if self.group is not None or self._stop.is_set():
                        raise
                    log.exception("the engine loop failed; ending its %d sequences and starting "
                                  "it again", len(self._active))
                    self._fail_active(f"the engine restarted after an internal error "
                                      f"({type(exc).__name__}); retry the request")
                    self.restarts += 1
        except BaseException as exc:  # the engine must never die silently
            log.exception("engine thread failed")
            self.error = exc
            self._fail_active(f"the engine stopped ({type(exc).__name__}: {exc}); retry the request")

    def _fail_active(self, message: str) -> None:
        """Ends the running sequences, and those taken from the queue but not yet running."""
        taken, self._taken = self._taken, []
        for seq in list(self._active.values()) + taken:
            self._finish(seq, "error", error=message, status=503)  # once: finished ones stay so
        self.stats.running, self.stats.waiting = 0, self._inbox.qsize()

    def _loop(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            if self.group is not None:
                mx.random.seed(0)  # unseeded sampling draws the same numbers on every rank
            gen = self._generator()
            busy = False
            while True:
                if busy and not self._active and self._inbox.empty():
                    self._release_freed()
                busy = bool(self._active)
                ops = self._next_ops(block=not self._active)
                if ops is None:
                    break
                self._taken = [op[1] for op in ops if op[0] == "add"]  # fail them if the loop does
                for op in ops:
                    self._apply(gen, op)
                self._taken = []
                if not self._active:
                    continue
                try:
                    self._step(gen)
                except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
                    log.exception("a decode step failed; ending the %d sequences of this "
                                  "batch with an error", len(self._active))
                    for seq in list(self._active.values()):
                        self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
                    gen = self._generator()

    @staticmethod
    def _release_freed() -> None:
        """On going idle: the C heap's free pages back to the system. A burst's prompts and steps
        free hundreds of MB of small allocations that stay resident otherwise (0.8B shape, after
        8 x 300-token prompts: 1,908 -> 1,572 MB); MLX's own buffer cache is not touched."""
        started = time.perf_counter()
        release_free_memory()
        log.debug("idle: freed heap pages released in %.1f ms", (time.perf_counter() - started) * 1e3)

    def _generator(self) -> BatchLoop:
        return BatchLoop(self.model, stop_tokens=self.eos_ids, max_batch=self.max_batch,
                         speculate=self.speculate, counters=self.spec_counters, prefill_batch=min(self.max_batch, 8), prefill_tokens=self.prefill_tokens)

    def _next_ops(self, block: bool) -> list | None:
        """What to apply before the next step: admissions and cancellations (None: stop)."""
        if self.rank > 0:
            return self._receive()
        ops: list = []
        stop = self._stop.is_set()
        try:
            item = self._inbox.get(timeout=0.05) if block and not stop else self._inbox.get_nowait()
        except queue.Empty:
            item = False
        while item is not False and not stop:
            if item is None:
                stop = True
                break
            ops.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = False
        if self.group is not None:
            # deadlines are rank 0's decision, shared as cancellations like any other
            now = time.monotonic()
            ops += [("cancel", seq, "timeout") for seq in self._active.values()
                    if seq.deadline is not None and now > seq.deadline]
            self._send(None if stop else ops)
        return None if stop else ops

    def _send(self, ops: list | None) -> None:
        wire = None if ops is None else [
            ("add", op[1].sid, op[1].prompt, op[1].params, op[1].draw_index, op[1].grammar)
            if op[0] == "add" else ("cancel", op[1].sid, op[2]) for op in ops]
        data = pickle.dumps(wire)
        mx.eval(mx.distributed.all_sum(mx.array(len(data)), group=self.group))
        mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)), group=self.group))

    def _receive(self) -> list | None:
        size = mx.distributed.all_sum(mx.array(0), group=self.group).item()
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
        wire = pickle.loads(bytes(np.array(data)))
        if wire is None:
            return None
        ops = []
        for op in wire:
            if op[0] == "add":
                _, sid, prompt, params, draw_index, grammar = op
                extra = []
                if grammar is not None:
                    extra.append(self.grammar_engine.processor(self.grammar_engine.compile(grammar)))
                seq = _Sequence(prompt=prompt, params=params, emit=lambda event: None,
                                extra_processors=extra, draw_index=draw_index, sid=sid,
                                grammar=grammar)
                self._by_sid[sid] = seq
                self.stats.waiting += 1
                ops.append(("add", seq))
            else:
                seq = self._by_sid.get(op[1])
                if seq is not None:
                    ops.append(("cancel", seq, op[2]))
        return ops

    def _apply(self, gen: BatchLoop, op) -> None:
        if op[0] == "add":
            self.stats.waiting -= 1
            seq = op[1]
            try:
                self._add(gen, seq)
            except Exception as exc:  # noqa: BLE001 - a request that cannot start ends alone
                log.exception("sequence %d could not be admitted", seq.sid)
                if seq.uid is not None and seq.uid in self._active:
                    gen.remove([seq.uid])
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
        elif op[0] == "cancel":
            seq, reason = op[1], op[2]
            if seq.uid is not None and seq.uid in self._active:
                gen.remove([seq.uid])
                self._finish(seq, reason)
            else:
                seq.cancelled = reason

    def _add(self, gen: BatchLoop, seq: _Sequence) -> None:
        if seq.cancelled:
            self._finish(seq, seq.cancelled)
            return
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.model_key, seq.prompt)
        if cache is None or not rest:
            cache, rest = None, seq.prompt
        seq.cached = len(seq.prompt) - len(rest)
        processors = [_guarded(seq, p, lambda tokens, logits: logits)
                       for p in make_processors(seq.params) + seq.extra_processors]
        draws = sampler = make_sampler(seq.params, seq.draw_index)
        if sampler is not greedy:  # one shared greedy sampler keeps greedy batches in one call
            sampler = _guarded(seq, sampler, greedy)
        marks = [(c, kind) for c, kind in self._marks.checkpoints(seq.prompt) if c > seq.cached]
        seq.checkpoints = dict(marks)
        cuts = [c - seq.cached for c, _ in marks]
        seq.uid = gen.insert([rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)])],
                             seq.params.max_tokens, cache=cache, tokens=seq.prompt[:seq.cached],
                             sampler=sampler, processors=processors,
                             draws=draws if draws is not greedy else None)
        seq.detok = self.tokenizer.detokenizer
        seq.detok.reset()
        seq.stops = StopMatcher(seq.params.stop)
        self._active[seq.uid] = seq
        self.stats.prompt_tokens_total += len(rest)
        self.stats.cached_tokens_total += seq.cached

    def _step(self, gen: BatchLoop) -> None:
        prompt_responses, responses = gen.next()
        # keep the prompt's cache at each checkpoint and without its last token, so a resend of
        # the same prefix (a conversation's next turn, another one with the same system prompt)
        # is free
        ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt
                and r.uid in self._active]
        for uid, (cache, tokens) in gen.extract_cache(ends).items():
            kind = self._active[uid].checkpoints.get(len(tokens), "user")
            self.prompt_cache.insert_cache(self.model_key, list(tokens), own_buffers(cache), cache_type=kind)
        self.stats.last_batch_size = len(responses)
        now = time.monotonic()
        failed = [seq for seq in self._active.values() if seq.failure is not None]
        if failed:  # their own sampler or processor raised: end them, not the batch
            gen.remove([seq.uid for seq in failed])
            for seq in failed:
                self._finish(seq, "error", error=seq.failure)
        to_remove = []
        for r in responses:
            seq = self._active.get(r.uid)
            if seq is None:
                continue
            seq.generated += 1
            seq.tokens.append(r.token)
            if seq.last_at is not None and self.on_token_gap is not None:
                self.on_token_gap(now - seq.last_at)
            seq.last_at = now
            self.stats.generation_tokens_total += 1
            if r.finish_reason == "stop":  # an EOS token: not part of the text
                seq.detok.finalize()
            else:
                seq.detok.add_token(r.token)
                if r.finish_reason is not None:
                    seq.detok.finalize()
            piece = seq.detok.last_segment
            text, hit = seq.stops.feed(piece)
            logprob = top = None
            if seq.params.logprobs:
                lp = r.logprobs
                logprob = max(lp[r.token].item(), MIN_LOGPROB)
                if seq.params.top_logprobs:
                    k = seq.params.top_logprobs
                    idx = mx.argpartition(-lp, k - 1)[:k]
                    vals = lp[idx]
                    order = mx.argsort(-vals)
                    top = [(t, max(v, MIN_LOGPROB)) for t, v in zip(idx[order].tolist(), vals[order].tolist())]
            if text or logprob is not None:
                seq.emit(TokenEvent(text=text, token=r.token, logprob=logprob, top_logprobs=top))
            if r.finish_reason is not None:
                if r.prompt_cache is not None:
                    self.prompt_cache.insert_cache(self.model_key, list(r.all_tokens),
                                                   own_buffers(r.prompt_cache), cache_type="assistant")
                self._finish(seq, r.finish_reason)
            elif hit:
                to_remove.append(seq)
                self._finish(seq, "stop")
            elif seq.deadline is not None and now > seq.deadline and self.group is None:
                to_remove.append(seq)
                self._finish(seq, "timeout")
        if to_remove:
            gen.remove([s.uid for s in to_remove])
        self.stats.running = len(self._active)
        self.stats.prefix_cache_bytes = self.prompt_cache.nbytes

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None,
                status: int = 500) -> None:
        if seq.done:
            return
        seq.done = True
        if seq.uid is not None:
            self._active.pop(seq.uid, None)
        self._by_sid.pop(seq.sid, None)
        # text held back for a stop string that never completed is real text
        tail = seq.stops.flush() if (seq.stops and reason in ("length", "stop")) else ""
        self.stats.running = len(self._active)
        seq.emit(FinishEvent(reason=reason, prompt_tokens=len(seq.prompt),
                             completion_tokens=seq.generated, cached_tokens=seq.cached,
                             text=tail, error=error, status=status, tokens=list(seq.tokens),
                             stop_sequence=seq.stops.matched if seq.stops else None))


def async_emitter(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[Any], None]:
    """An `emit` callback that hands events from the engine thread to an asyncio queue."""
    def emit(event: Any) -> None:
        loop.call_soon_threadsafe(q.put_nowait, event)
    return emit
