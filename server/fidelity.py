"""Fidelity spot checks: a share of finished requests re-scored by the bf16 reference.

Off the hot path: a finished request is offered to a bounded queue (sampled by
`fidelity.sample_rate`, capped per minute); when the queue is full the check is dropped and the
drop counted, never waited for. A worker thread teacher-forces the same prompt and generated
tokens through the served model and through the reference, and compares, at every generated
position, the two next-token distributions: KL(reference || served), whether their top-1 agree,
whether the served token was the reference's top-1 ("flip" when not), and where they first
disagree. A request decoded under a grammar (JSON, tool calls) is compared over what the grammar
allowed at each position (its masks replayed over the generated tokens): a token the grammar
forced is the choice any model would have made there, not a flip.

The reference is the unquantized checkpoint the variant was made from, loaded lazily in this
process within a memory budget, or another mixbit instance serving bf16 (`fidelity.reference =
"http://host:port"`), asked through its `POST /v1/score` for the top-k log-probabilities at each
position; KL is then computed over those k tokens plus one bucket for the rest (a lower bound of
the full KL by the log-sum inequality).
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mixbit.models.forward import score
from mixbit.models.chat.grammar import GrammarReplay

log = logging.getLogger("mixbit.fidelity")


@dataclass
class Job:
    kind: str  # chat, tool_call, json, completion
    prompt: list[int]
    tokens: list[int]  # generated, as sampled (an end-of-turn token included)
    request_id: str
    queued_at: float = field(default_factory=time.time)
    grammar: Any = None  # the CompiledGrammar the request decoded under, if any
    variant: str = ""  # the served variant that generated it (its metrics' label)
    model: Any = None  # that variant's model, which the check re-scores the tokens with


@dataclass
class Check:
    request_id: str
    kind: str
    variant: str
    tokens: int
    kld_mean: float
    kld_max: float
    top1_agreement: float
    flips: int
    first_divergence: int | None
    seconds: float
    at: float


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forward_logprobs(model, ids: list[int], start: int) -> mx.array:
    """Log-probabilities [n, vocab] the model gives to positions start..len(ids)-1 (each row
    predicts ids[start + i]), teacher-forced in one pass without a cache."""
    logits = score(model, mx.array([ids[:-1]]))[0, start - 1:]
    return log_softmax(logits)


def chunked_logprobs(model, ids: list[int], start: int, chunk: int,
                     pause: Callable[[], None] = lambda: None):
    """The rows of `forward_logprobs`, computed `chunk` tokens at a time with a prompt cache and
    yielded as (first row, log-probs) so that memory stays at one chunk of vocabulary rows;
    `pause()` runs between chunks (the worker yields to serving there). Prompt chunks are
    evaluated through the cache state only, so the head never runs on prompt positions."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    inputs = ids[:-1]
    pos = 0
    while pos < len(inputs):
        end = min(pos + chunk, len(inputs))
        logits = score(model, mx.array([inputs[pos:end]]), cache=cache)[0]
        first = max(start - 1, pos)
        if first < end:
            lp = log_softmax(logits[first - pos:])
            mx.eval(lp, [c.state for c in cache])
            yield first - (start - 1), lp
        else:
            mx.eval([c.state for c in cache])
        pos = end
        if pos < len(inputs):
            pause()


def compare(ref_lp: mx.array, served_lp: mx.array, tokens: list[int]) -> dict:
    """Exact comparison of full distributions at each generated position."""
    return _summary(*_compare_rows(ref_lp, served_lp), tokens)


def restrict(lp: mx.array, allowed: mx.array | None) -> mx.array:
    """Log-probabilities renormalized over the tokens a grammar allowed (-inf elsewhere): what
    the constrained decoder actually sampled from."""
    if allowed is None:
        return lp
    return log_softmax(mx.where(allowed, lp, mx.array(-mx.inf, dtype=lp.dtype)))


def _compare_rows(ref_lp: mx.array, served_lp: mx.array, allowed: mx.array | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ref_lp, served_lp = restrict(ref_lp, allowed), restrict(served_lp, allowed)
    p = mx.exp(ref_lp)
    terms = p * (ref_lp - served_lp)
    if allowed is not None:  # 0 * (-inf - -inf) outside what the grammar allowed
        terms = mx.where(allowed, terms, 0.0)
    kld = mx.sum(terms, axis=-1)
    ref_top = mx.argmax(ref_lp, axis=-1)
    served_top = mx.argmax(served_lp, axis=-1)
    mx.eval(kld, ref_top, served_top)
    return np.maximum(np.array(kld), 0.0), np.array(ref_top), np.array(served_top)


def _topk_rows(ref_top: list[list[tuple[int, float]]], served_lp: mx.array,
               allowed: mx.array | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Under a grammar, the reference's top-k is cut to the allowed tokens and renormalized
    over them (allowed mass outside its top-k is taken as negligible)."""
    served = np.array(restrict(served_lp, allowed))
    ok = np.array(allowed) if allowed is not None else None
    klds, ref_first = [], []
    for i, row in enumerate(ref_top):
        ids = np.array([t for t, _ in row], dtype=np.int64)
        lp = np.array([v for _, v in row], dtype=np.float64)
        if ok is not None:
            keep = ok[i, ids]
            if keep.any():
                ids, lp = ids[keep], lp[keep]
                lp = lp - np.logaddexp.reduce(lp)
        p = np.exp(lp)
        q_lp = served[i, ids].astype(np.float64)
        kl = float(np.sum(p * (lp - q_lp)))
        p_tail, q_tail = max(1.0 - p.sum(), 1e-12), max(1.0 - np.exp(q_lp).sum(), 1e-12)
        kl += p_tail * (np.log(p_tail) - np.log(q_tail))
        klds.append(max(kl, 0.0))
        ref_first.append(int(ids[0]))
    return np.array(klds), np.array(ref_first, dtype=np.int64), np.argmax(served, axis=-1)


def _summary(kld: np.ndarray, ref_top: np.ndarray, served_top: np.ndarray, tokens: list[int]) -> dict:
    agree = ref_top == served_top
    disagree = np.nonzero(~agree)[0]
    return {"tokens": len(tokens), "kld_mean": float(kld.mean()) if kld.size else 0.0,
            "kld_max": float(kld.max()) if kld.size else 0.0,
            "top1_agreement": float(agree.mean()) if agree.size else 1.0,
            "flips": int(np.sum(ref_top != np.array(tokens))),
            "first_divergence": int(disagree[0]) if disagree.size else None}


class LocalReference:
    """The unquantized checkpoint, loaded on first use (or the served model itself for bf16)."""

    def __init__(self, loader: Callable[[], Any], describe: str):
        self._loader = loader
        self.describe = describe
        self.model = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self.model is None:
                started = time.time()
                self.model = self._loader()
                log.info("fidelity reference %s loaded in %.1fs", self.describe, time.time() - started)
        return self.model


class RemoteReference:
    """Another mixbit instance serving the bf16 model; its /v1/score gives top-k per position."""

    exact = False

    def __init__(self, url: str, api_key: str = "", top_k: int = 64, timeout: float = 60.0):
        import httpx

        self.describe = url
        self.top_k = top_k
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def top(self, ids: list[int], start: int) -> list[list[tuple[int, float]]]:
        r = self._client.post("/v1/score", json={"tokens": ids, "start": start, "top_k": self.top_k})
        r.raise_for_status()
        return [[(int(t), float(v)) for t, v in row] for row in r.json()["top_logprobs"]]


class FidelityWorker:
    """Runs the checks in a background thread that yields to serving: while an engine has
    sequences to decode (`busy()`), the worker's compute is held to `busy_share` of wall time,
    in slices of `chunk` tokens; when the engines are idle the checks run at full speed. Checks
    that cannot keep up wait in the bounded queue, and beyond it are dropped and counted. One
    worker and one reference serve every variant: a job names its variant and model."""

    def __init__(self, reference, metrics, *, sample_rate: float,
                 max_per_minute: int, queue_size: int, max_tokens: int, keep: int, seed: int = 0,
                 busy: Callable[[], bool] = lambda: False, busy_share: float = 0.02,
                 chunk: int = 128):
        self.reference = reference
        self.metrics = metrics
        self.sample_rate = sample_rate
        self.max_per_minute = max_per_minute
        self.max_tokens = max_tokens
        self.busy = busy
        self.busy_share = busy_share
        self.chunk = chunk
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.recent: collections.deque[Check] = collections.deque(maxlen=keep)
        self._rng = random.Random(seed)
        self._window: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self._slice_start = time.perf_counter()
        self._paused = 0.0
        self._closed = threading.Event()
        self.checking = False  # a check is in progress (resting or computing)
        self.disabled: str | None = None
        self._thread = threading.Thread(target=self._run, name="mixbit-fidelity", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass

    def offer(self, job: Job) -> bool:
        """Called when a request finishes; never blocks. True when the job was queued."""
        if not job.tokens:
            return False
        with self._lock:
            if self._rng.random() >= self.sample_rate:
                return False
            if self.disabled:
                self.metrics.fid_dropped.labels("reference_unavailable", job.variant).inc()
                return False
            now = time.monotonic()
            while self._window and now - self._window[0] > 60:
                self._window.popleft()
            if len(self._window) >= self.max_per_minute:
                self.metrics.fid_dropped.labels("rate_cap", job.variant).inc()
                return False
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                self.metrics.fid_dropped.labels("queue_full", job.variant).inc()
                return False
            self._window.append(now)
            return True

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            while True:
                job = self.queue.get()
                if job is None:
                    return
                self.checking = True
                try:
                    self._check(job)
                except Exception as exc:  # noqa: BLE001 - a failed check must not stop the worker
                    log.warning("fidelity check failed: %s", exc)
                    self.metrics.fid_dropped.labels("error", job.variant).inc()
                finally:
                    self.checking = False

    def _yield(self) -> None:
        """Between slices: while serving is busy, rest long enough that this slice's compute is at
        most `busy_share` of the time since it began; resume as soon as serving goes idle."""
        now = time.perf_counter()
        worked = now - self._slice_start
        share = self.busy_share
        rest = float("inf") if share <= 0 else worked * (1.0 - share) / share
        waited = 0.0
        while waited < rest and self.busy() and not self._closed.is_set():
            step = min(0.01, rest - waited)
            time.sleep(step)
            waited += step
        self._paused += time.perf_counter() - now
        self._slice_start = time.perf_counter()

    def _check(self, job: Job) -> None:
        started = time.perf_counter()
        self._paused = 0.0
        self._slice_start = started
        tokens = job.tokens[: self.max_tokens]
        ids = job.prompt + tokens
        start = len(job.prompt)
        served = chunked_logprobs(job.model, ids, start, self.chunk, self._yield)
        # under a grammar both distributions are compared over what it allowed at each position
        replay = GrammarReplay(job.grammar) if job.grammar is not None else None

        def allowed(i: int, lp: mx.array):
            return replay.rows(tokens[i:i + lp.shape[0]], lp.shape[-1]) if replay else None

        if isinstance(self.reference, RemoteReference):
            top = self.reference.top(ids, start)  # the reference's compute is elsewhere
            parts = [_topk_rows(top[i:i + lp.shape[0]], lp, allowed(i, lp)) for i, lp in served]
        else:
            ref = chunked_logprobs(self.reference.get(), ids, start, self.chunk, self._yield)
            parts = [_compare_rows(r, s, allowed(i, s)) for (_, r), (i, s) in zip(ref, served)]
        kld, ref_top, served_top = (np.concatenate(x) for x in zip(*parts))
        summary = _summary(kld, ref_top, served_top, tokens)
        self._yield()  # the last slice's rest, before the next check starts
        compute = time.perf_counter() - started - self._paused
        check = Check(request_id=job.request_id, kind=job.kind, variant=job.variant,
                      seconds=round(compute, 4), at=time.time(), **summary)
        self.recent.append(check)
        m, labels = self.metrics, (job.variant, job.kind)
        m.fid_checks.labels(*labels).inc()
        m.fid_tokens.labels(*labels).inc(check.tokens)
        m.fid_flips.labels(*labels).inc(check.flips)
        m.fid_kld.labels(*labels).observe(check.kld_mean)
        m.fid_top1.labels(*labels).observe(check.top1_agreement)
        if check.first_divergence is not None:
            m.fid_first.labels(*labels).observe(check.first_divergence)
        m.fid_seconds.observe(check.seconds)

    def view(self, limit: int = 50, variant: str | None = None) -> dict:
        """The latest `limit` checks (of one variant, if named), newest first, and the settings."""
        checks = [c for c in self.recent if variant is None or c.variant == variant][-limit:][::-1]
        return {"reference": self.reference.describe,
                "sample_rate": self.sample_rate, "max_per_minute": self.max_per_minute,
                "queue_depth": self.queue.qsize(), "checking": self.checking,
                "busy_share": self.busy_share, "disabled": self.disabled,
                "checks": [asdict(c) for c in checks]}


def score_top(model, ids: list[int], start: int, top_k: int) -> list[list[tuple[int, float]]]:
    """What /v1/score returns: the top-k (token, log-prob) at each position from `start`."""
    lp = forward_logprobs(model, ids, start)
    k = min(top_k, lp.shape[-1])
    idx = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    idx, vals = mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
