"""A checkpoint run one decoder layer at a time, so quantization never holds the model in float32.

mlx-lm loads the checkpoint lazily (its own sanitize: HF layout -> MLX layout, vision tower and
MTP head dropped); weights stay in their stored dtype (bf16) and are read from disk when first
used. Each layer runs in float32 from a transient copy of its weights (MLX's CPU backend has no
fast bf16 matmul), and the 248k-row head is applied in vocabulary chunks, so the float32 working
set is one layer plus one chunk of the head, whatever the model's size.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .formats import quantizable

HEAD_CHUNK = 32768  # vocabulary rows cast to float32 at a time


class Recorder(nn.Module):
    """Stands in for a linear layer during a forward: passes through, and accumulates the mean
    square of its input per input channel (llama.cpp's importance matrix)."""

    def __init__(self, inner: nn.Module, stats: dict, key: str):
        super().__init__()
        self.inner = inner
        self._stats, self._key = stats, key

    def __call__(self, x, *args, **kwargs):
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        sq = (flat * flat).sum(axis=0)
        old = self._stats.get(self._key)
        self._stats[self._key] = (sq, flat.shape[0]) if old is None else (old[0] + sq, old[1] + flat.shape[0])
        return self.inner(x, *args, **kwargs)


def _set_child(root: nn.Module, dotted: str, value: nn.Module) -> None:
    parts = dotted.split(".")
    parent = root
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else getattr(parent, p)
    setattr(parent, parts[-1], value)


def _get_child(root: nn.Module, dotted: str):
    obj = root
    for p in dotted.split("."):
        obj = obj[int(p)] if isinstance(obj, list) else getattr(obj, p)
    return obj


class LayerStream:
    """The model of a folder, as embeddings, decoder layers and a head that run one at a time."""

    def __init__(self, folder: Path):
        from mlx_lm.utils import load_config, load_model

        from mixbit.models.forward.qwen3_5 import MODEL_TYPES, model_classes

        self.folder = Path(folder)
        # mixbit's forward (GatedDeltaNet on the CPU kernel or chunk-parallel, not mlx-lm's
        # per-token loop), its projections left as loaded: MLX's own layers
        ours = load_config(self.folder).get("model_type") in MODEL_TYPES
        self.model, self.config = load_model(self.folder, lazy=True, strict=True,
                                             **({"get_model_classes": model_classes} if ours else {}))
        if ours:  # the MTP head is quantized from the checkpoint's files (writer.py), not streamed
            self.model.detach_mtp()
        lm = getattr(self.model, "language_model", self.model)
        self.lm = lm
        self.text = lm.model
        self.layers = list(self.text.layers)
        self.tied = bool(getattr(lm.args, "tie_word_embeddings", False)) or not hasattr(lm, "lm_head")
        self.prefix = "language_model.model" if hasattr(self.model, "language_model") else "model"
        self.head_path = (f"{self.prefix}.embed_tokens" if self.tied else
                          self.prefix.rsplit(".model", 1)[0] + ".lm_head" if self.prefix != "model"
                          else "lm_head")
        self.vocab = int(self.text.embed_tokens.weight.shape[0])
        self._masks: dict = {}

    # ------------------------------------------------------------------ naming
    def layer_path(self, i: int) -> str:
        return f"{self.prefix}.layers.{i}"

    def layer_tensors(self, i: int) -> dict[str, nn.Module]:
        """Full path -> quantizable module of layer i."""
        base = self.layer_path(i)
        return {f"{base}.{p}": m for p, m in quantizable(self.layers[i]).items()}

    def outer_tensors(self) -> dict[str, nn.Module]:
        """Quantizable modules outside the decoder layers: embeddings and an untied head."""
        out = {f"{self.prefix}.embed_tokens": self.text.embed_tokens}
        if not self.tied:
            out[self.head_path] = self.lm.lm_head
        return out

    def all_tensors(self) -> dict[str, nn.Module]:
        out = dict(self.outer_tensors())
        for i in range(len(self.layers)):
            out.update(self.layer_tensors(i))
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ running
    def masks(self, h: mx.array):
        key = tuple(h.shape[:2])
        if key not in self._masks:
            from mlx_lm.models.base import create_attention_mask, create_ssm_mask

            self._masks = {key: (create_attention_mask(h, None), create_ssm_mask(h, None))}
        return self._masks[key]

    def embed(self, rows: mx.array, fmt=None) -> mx.array:
        """Embeddings of token rows in float32; with `fmt`, as that quantization of the table
        would give them (groups run along a row, so the looked-up rows quantize alone)."""
        if fmt is None or fmt.bits == 16:
            return self.text.embed_tokens(rows).astype(mx.float32)
        from .formats import fake_quantize

        picked = fake_quantize(self.text.embed_tokens.weight[rows.reshape(-1)], fmt)
        return picked.reshape(*rows.shape, -1).astype(mx.float32)

    @contextmanager
    def float32(self, module: nn.Module) -> Iterator[nn.Module]:
        """The module with float32 copies of its weights, for the duration of the block."""
        saved = module.parameters()
        module.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating)
                               else a, saved))
        try:
            yield module
        finally:
            module.update(saved)

    def run_layer(self, i: int, h: mx.array, record: dict | None = None) -> mx.array:
        """Layer i on hidden states h (float32); with `record`, each quantizable module's input
        statistics are added to it under the module's full path."""
        layer = self.layers[i]
        fa_mask, ssm_mask = self.masks(h)
        mask = ssm_mask if layer.is_linear else fa_mask
        swapped = []
        if record is not None:
            base = self.layer_path(i)
            for rel in quantizable(layer):
                module = _get_child(layer, rel)
                _set_child(layer, rel, Recorder(module, record, f"{base}.{rel}"))
                swapped.append((rel, module))
        try:
            with self.float32(layer):
                out = layer(h, mask=mask, cache=None)
                mx.eval(out, *(v[0] for v in (record or {}).values()))
        finally:
            for rel, module in swapped:
                _set_child(layer, rel, module)
        return out

    def final_norm(self, h: mx.array) -> mx.array:
        with self.float32(self.text.norm):
            out = self.text.norm(h)
            mx.eval(out)
        return out

    def head_weight(self) -> mx.array:
        return self.text.embed_tokens.weight if self.tied else self.lm.lm_head.weight

    def logprobs(self, normed: mx.array, weight=None, token_chunk: int = 64) -> mx.array:
        """log-softmax of the head over normed hidden states [T, hidden] (float32). The head's
        rows are cast to float32 a chunk at a time (`weight` replaces the head, e.g. a quantized
        one read chunk by chunk), tokens go `token_chunk` at a time: memory is the result plus
        one chunk."""
        return mx.concatenate([self._logprobs(normed[s:s + token_chunk], weight)
                               for s in range(0, normed.shape[0], token_chunk)], axis=0)

    def _logprobs(self, normed: mx.array, weight=None) -> mx.array:
        w = self.head_weight() if weight is None else weight
        parts = []
        for start in range(0, w.shape[0], HEAD_CHUNK):
            chunk = w[start:start + HEAD_CHUNK].astype(mx.float32)
            parts.append(normed @ chunk.T)
            mx.eval(parts[-1])
        logits = mx.concatenate(parts, axis=-1)
        del parts
        out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(out)
        return out

    def compare(self, ref: mx.array, normed: mx.array, weight=None,
                token_chunk: int = 64) -> tuple[mx.array, mx.array]:
        """Per position: KL(ref || head(normed)) and whether the top tokens agree, without
        holding the second distribution whole (`ref`: reference log-probabilities)."""
        klds, same = [], []
        for s in range(0, normed.shape[0], token_chunk):
            got = self._logprobs(normed[s:s + token_chunk], weight)
            r = ref[s:s + token_chunk]
            klds.append(kld_rows(r, got))
            same.append(r.argmax(-1) == got.argmax(-1))
            mx.eval(klds[-1], same[-1])
        return mx.concatenate(klds), mx.concatenate(same)


class ChunkedFakeQuant:
    """A head weight whose row chunks are quantized and dequantized as they are read (the
    quantized 248k-row head never exists whole)."""

    def __init__(self, w: mx.array, fmt):
        self.w, self.fmt, self.shape = w, fmt, w.shape

    def __getitem__(self, rows: slice) -> mx.array:
        from .formats import fake_quantize

        return fake_quantize(self.w[rows], self.fmt)


def kld_rows(ref: mx.array, got: mx.array) -> mx.array:
    """KL(ref || got) per position, both log-probabilities [T, V]."""
    return (mx.exp(ref) * (ref - got)).sum(axis=-1)
