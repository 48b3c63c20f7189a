"""llama-perplexity's KL-divergence protocol, shared by MLX variants and GGUF files.

llama.cpp measures a quant's KLD in two runs: `--kl-divergence-base FILE` stores the reference's
log-probabilities, `--kl-divergence` evaluates another model on the tokens stored in that file and
compares. The file (tools/perplexity/perplexity.cpp) is:

    "_logits_"  n_ctx:u32  n_vocab:i32  n_chunk:i32  tokens:i32[n_chunk * n_ctx]
    then per chunk, for positions n_ctx/2 .. n_ctx-2 (each predicts the next token), a row of
    nv = 2*ceil(n_vocab/2) + 4 uint16: (scale:f32, min_log_prob:f32), then per token
    round((logit - min_logit) / scale), where min_logit = max(min logit, max logit - 16) and
    scale = (max - min_logit) / 65535: log p = scale * q + min_log_prob.

mixbit writes that file itself from its bf16 model, on its own tokens (the chat template's control
tokens parsed; llama-perplexity's own tokenizer run would read `<|im_start|>` as text), and reads
it back for both sides: llama-perplexity evaluates GGUF files against it, `kld()` here evaluates
MLX variants with the same arithmetic (tokens whose reference log-probability is below -16 are
left out of the sum, top-1 agreement compares the candidate's arg-max with the stored one). The
reference is mixbit's bf16 for both frameworks; llama.cpp's own bf16 GGUF of the same weights,
measured against it, gives the floor that separates the frameworks (tests/test_gguf.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
CUTOFF = 16.0  # nats below the top logit that the base keeps (llama.cpp's constant)


def row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


@dataclass
class Base:
    """A --kl-divergence-base file: tokens, and the reference log-probabilities per chunk."""

    path: Path
    n_ctx: int
    n_vocab: int
    tokens: np.ndarray  # (n_chunk, n_ctx) int32

    @property
    def n_chunk(self) -> int:
        return self.tokens.shape[0]

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    def log_probs(self, chunk: int) -> np.ndarray:
        """(rows_per_chunk, n_vocab) float32 reference log-probabilities of one chunk."""
        nv = row_width(self.n_vocab)
        head = 8 + 12 + 4 * self.tokens.size
        rows = np.memmap(self.path, dtype=np.uint16, mode="r", offset=head + 2 * chunk * self.rows_per_chunk * nv,
                         shape=(self.rows_per_chunk, nv))
        scale_min = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # (rows, 2)
        q = rows[:, 4:4 + self.n_vocab].astype(np.float32)
        return scale_min[:, :1] * q + scale_min[:, 1:2]


def read_base(path: str | Path) -> Base:
    path = Path(path)
    with open(path, "rb") as fh:
        if fh.read(8) != MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity log-probability file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(fh.read(12), dtype=np.int32)
        tokens = np.frombuffer(fh.read(4 * n_chunk * n_ctx), dtype=np.int32).reshape(n_chunk, n_ctx)
    base = Base(path, int(n_ctx), int(n_vocab), tokens.copy())
    want = 20 + 4 * tokens.size + 2 * n_chunk * base.rows_per_chunk * row_width(n_vocab)
    if path.stat().st_size != want:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, expected {want} (cut short?)")
    return base


def encode_rows(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's 16-bit log-probability rows of `logits` (rows, n_vocab)."""
    logits = logits.astype(np.float32)
    n, n_vocab = logits.shape
    top = logits.max(axis=1)
    low = np.maximum(logits.min(axis=1), top - CUTOFF)
    lse = np.log(np.exp((logits - top[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    min_log_prob = (low - top - lse).astype(np.float32)
    scale = ((top - low) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    out[:, :4] = np.stack([scale, min_log_prob], axis=1).astype(np.float32).view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((logits - low[:, None]) * (np.float32(1) / scale)[:, None])
    q = np.where((logits > low[:, None]) & (scale[:, None] > 0), q, 0)
    out[:, 4:4 + n_vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def write_base(path: str | Path, tokens: np.ndarray, logits_of: Callable[[np.ndarray], np.ndarray]) -> Base:
    """Writes the base file for `tokens` (n_chunk, n_ctx), `logits_of(chunk_tokens)` giving a
    chunk's (n_ctx, n_vocab) logits; whole or not at all."""
    path = Path(path)
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    n_chunk, n_ctx = tokens.shape
    first = n_ctx // 2
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            n_vocab = None
            for c in range(n_chunk):
                logits = np.asarray(logits_of(tokens[c]), dtype=np.float32)
                if n_vocab is None:
                    n_vocab = logits.shape[-1]
                    fh.write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], dtype=np.int32).tobytes())
                    fh.write(tokens.tobytes())
                fh.write(encode_rows(logits[first:n_ctx - 1]).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return read_base(path)


@dataclass
class KLD:
    mean: float
    p99: float
    top1: float  # share of positions whose arg-max agrees with the reference's
    ppl: float  # perplexity of the candidate on the scored tokens
    ppl_base: float
    count: int

    def row(self) -> dict:
        return {"kld_mean": self.mean, "kld_p99": self.p99, "top1": self.top1, "ppl": self.ppl,
                "ppl_base": self.ppl_base, "tokens": self.count}


def kld(base: Base, logits_of: Callable[[np.ndarray], np.ndarray], chunks: int | None = None) -> KLD:
    """A candidate (`logits_of(chunk_tokens)` -> (n_ctx, n_vocab)) against the base, with
    llama-perplexity's arithmetic; `chunks`: only the first so many."""
    values, same, nll, nll_base = [], 0, 0.0, 0.0
    f, last = base.first, base.n_ctx - 1
    for c in range(base.n_chunk if chunks is None else min(chunks, base.n_chunk)):
        ref = base.log_probs(c).astype(np.float64)
        logits = np.asarray(logits_of(base.tokens[c]), dtype=np.float64)[f:last]
        top = logits.max(axis=1, keepdims=True)
        lp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        keep = ref > -CUTOFF
        values.append(np.where(keep, np.exp(ref) * (ref - lp), 0.0).sum(axis=1))
        same += int((logits.argmax(axis=1) == ref.argmax(axis=1)).sum())
        nxt = base.tokens[c, f + 1:last + 1]
        nll -= lp[np.arange(len(nxt)), nxt].sum()
        nll_base -= ref[np.arange(len(nxt)), nxt].sum()
    v = np.concatenate(values)
    return KLD(mean=float(v.mean()), p99=float(np.percentile(v, 99)), top1=same / v.size,
               ppl=math.exp(nll / v.size), ppl_base=math.exp(nll_base / v.size), count=int(v.size))


_LLAMA_LINES = {
    "kld_mean": r"Mean\s+KLD:\s+(-?[\d.]+)",
    "kld_p99": r"99\.0%\s+KLD:\s+(-?[\d.]+)",
    "top1": r"Same top p:\s+([\d.]+)",
    "ppl": r"Mean PPL\(Q\)\s+:\s+([\d.]+)",
    "ppl_base": r"Mean PPL\(base\)\s+:\s+([\d.]+)",
}


def parse_llama_perplexity(output: str) -> dict:
    """The statistics llama-perplexity --kl-divergence prints, as kld()'s row."""
    out = {}
    for key, pattern in _LLAMA_LINES.items():
        m = re.search(pattern, output)
        if m is None:
            raise ValueError(f"llama-perplexity printed no {key} ({pattern!r}); its output ends: {output[-800:]}")
        out[key] = float(m.group(1)) / (100.0 if key == "top1" else 1.0)
    return out
