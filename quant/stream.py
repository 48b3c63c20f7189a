"""A checkpoint run one decoder layer at a time: quantizing holds one layer, never the model.

The model is built by mlx-lm's loader (lazily, through mixbit's forward and its sanitize: HF
layout -> MLX layout, vision tower and MTP head left out), but its weights are never evaluated:
they stand in for shapes and names only. Whoever needs a layer's values takes them with
`with stream.layer(i)`: fresh arrays read from the safetensors files (quant/checkpoint.py), in
the layer for the duration of the block and dropped after it, so what stays in memory does not
grow with depth or checkpoint size. Each layer runs in float32 (MLX's CPU backend has no fast
bf16 matmul); the embedding table and the 248k-row head are read by token and in vocabulary
chunks through a memory map. Working set: one layer (stored + float32), one chunk of the head,
the calibration activations.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .checkpoint import Checkpoint, Rows
from .formats import Format, fake_quantize, quantizable

HEAD_CHUNK = 32768  # vocabulary rows cast to float32 at a time, at most
HEAD_CHUNK_BYTES = 128 << 20  # ... and at most this many bytes of them in float32
REF_CHUNK_BYTES = 256 << 20  # [tokens, vocabulary] float32 log-probabilities made at a time
EXPERT_CHUNK_BYTES = 128 << 20  # routed experts cast to float32 at a time (MoE layers)


def _f32(a: mx.array) -> mx.array:
    """float32 for a floating vector of a layer (norms, biases, the GatedDeltaNet's decays).
    Matrices stay as stored: a linear's weight is made float32 at its call (`Float32Linear`);
    stacked experts (3-D) a chunk of experts at a time by the MoE block (`expert_chunk`)."""
    if a.ndim >= 2 or not mx.issubdtype(a.dtype, mx.floating):
        return a
    return a.astype(mx.float32)


class Float32Linear(nn.Linear):
    """A linear layer of a streamed layer, computed in float32 from the weight it holds: the
    float32 weight made at the call and dropped after the product, which is evaluated there.
    The numbers of a layer holding a float32 copy, with one matrix's copy at a time instead of
    the whole layer's (1.5 GB at 27B's width). `float32_weight` says how the copy is made (the
    writer's check dequantizes a packed weight)."""

    def __init__(self, source: nn.Module):
        nn.Module.__init__(self)
        self.weight = source["weight"]
        if "bias" in source:
            self.bias = source["bias"]

    def float32_weight(self) -> mx.array:
        return self["weight"].astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        w = self.float32_weight()
        y = mx.addmm(self["bias"].astype(mx.float32), x, w.T) if "bias" in self else x @ w.T
        mx.eval(y)
        return y


def float32_linears(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """Puts a Float32Linear in place of each plain linear of `layer` whose weight is not float32;
    returns (path, original) to put back with `_set_child`."""
    swapped = []
    for path, module in layer.named_modules():
        if type(module) is nn.Linear and module.weight.dtype != mx.float32:
            swapped.append((path, module))
    for path, module in swapped:
        _set_child(layer, path, Float32Linear(module))
    return swapped


class Recorder(nn.Module):
    """Stands in for a linear layer during a forward: passes through, and accumulates the mean
    square of its input per input channel (llama.cpp's importance matrix). For a stack of
    routed experts, one row per expert (`observe`)."""

    def __init__(self, inner: nn.Module, stats: dict, key: str):
        super().__init__()
        self.inner = inner
        self._stats, self._key = stats, key

    def __call__(self, x, *args, **kwargs):
        self.observe(x)
        return self.inner(x, *args, **kwargs)

    def observe(self, x, experts: mx.array | None = None, n_experts: int = 0, weights: mx.array | None = None,
                tokens: float = 0.0) -> None:
        """Adds x's rows to the statistics (callers that use `weight` directly, like the MoE
        block's expert chunks, report their inputs here).

        Routed experts: row r went to expert `experts[r]` with routing weight `weights[r]`, and
        the rows stand for `tokens` tokens. Each expert gets its own importance row, from the
        rows routed to it, weighted by the squared routing weight (its output enters the block's
        sum scaled by it), over the tokens: [n_experts, in], zero for an expert no token reached.
        A stack's quantization error (probe.weighted_errors) is then each expert's error under
        its own inputs, and a dense linear's and an expert stack's are the same measure, the
        disturbance of a token's output."""
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        if experts is None:
            sq, n = (flat * flat).sum(axis=0), flat.shape[0]
        else:
            rows = flat * flat * (weights.reshape(-1, 1).astype(mx.float32) ** 2)
            sq = mx.zeros((n_experts, flat.shape[1]), dtype=mx.float32).at[experts.reshape(-1)].add(rows)
            n = tokens
        old = self._stats.get(self._key)
        self._stats[self._key] = (sq, n) if old is None else (old[0] + sq, old[1] + n)

    @property
    def weight(self) -> mx.array:
        return self.inner.weight


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
        # per-token loop), its projections left as loaded: MLX's own layers. The loaded weights
        # are never evaluated (see `layer`): the model is built for its structure.
        ours = load_config(self.folder).get("model_type") in MODEL_TYPES
        self.model, self.config = load_model(self.folder, lazy=True, strict=True,
                                             **({"get_model_classes": model_classes} if ours else {}))
        if ours:  # the MTP head is quantized from the checkpoint's files (writer.py), not streamed
            self.model.detach_mtp()
        self.checkpoint = Checkpoint(self.folder)
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
        for layer in self.layers:  # MoE: experts a chunk at a time (see _f32)
            if hasattr(layer.mlp, "expert_chunk"):
                w = layer.mlp.switch_mlp.gate_proj.weight
                per_expert = 3 * 4 * w.shape[1] * w.shape[2]
                layer.mlp.expert_chunk = max(1, min(w.shape[0], EXPERT_CHUNK_BYTES // per_expert))
        # the model's own names of the tensors outside the layers -> the checkpoint's names
        # (the embedding and head are renamed only: their rows are read from the file)
        raw = self.checkpoint.lazy(self._wanted)
        by_id = {id(v): k for k, v in raw.items()}
        fresh = self.model.sanitize(dict(raw)) if hasattr(self.model, "sanitize") else dict(raw)
        self.outer_weights = {k: v for k, v in fresh.items() if f"{self.prefix}.layers." not in k}
        self._sources = {k: by_id[id(v)] for k, v in self.outer_weights.items() if id(v) in by_id}
        del raw, fresh
        sources = self._layer_sources()
        self.layer_bytes = [self.checkpoint.nbytes(n) for n in sources]
        # routed experts (held in the stored dtype, computed a chunk at a time)
        self.expert_bytes = [self.checkpoint.nbytes([k for k in n if ".mlp.experts." in k]) for n in sources]
        # the largest matrix outside them, in float32 (one is made at a time: Float32Linear)
        self.matrix_f32_bytes = max((4 * int(np.prod(e.shape)) for n in sources for k in n
                                     if len((e := self.checkpoint.entries[k]).shape) == 2
                                     and ".mlp.experts." not in k), default=0)

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _wanted(name: str) -> bool:
        return not name.startswith(("mtp.", "model.visual.", "vision_tower.", "model.mtp."))

    def _sanitized(self, keep=None) -> dict[str, mx.array]:
        """Fresh unevaluated weights of the checkpoint in the model's names (its own sanitize:
        it decides conventions from the whole set of tensors, so it sees all of them; nothing
        is read until a returned array is evaluated)."""
        raw = self.checkpoint.lazy(self._wanted)
        out = self.model.sanitize(raw) if hasattr(self.model, "sanitize") else raw
        return out if keep is None else {k: v for k, v in out.items() if keep(k)}

    def _layer_sources(self) -> list[list[str]]:
        """Checkpoint tensor names of each decoder layer."""
        out: list[list[str]] = [[] for _ in self.layers]
        for name in self.checkpoint.entries:
            parts = name.split(".")
            if self._wanted(name) and "layers" in parts:
                i = parts.index("layers") + 1
                if i < len(parts) and parts[i].isdigit() and int(parts[i]) < len(out):
                    out[int(parts[i])].append(name)
        return out

    def layer_weights(self, i: int) -> dict[str, mx.array]:
        """Layer i's weights (relative names, stored dtypes), fresh and unevaluated."""
        pfx = f"{self.layer_path(i)}."
        return {k[len(pfx):]: v for k, v in self._sanitized(lambda k: k.startswith(pfx)).items()}

    @contextmanager
    def layer(self, i: int, *, float32: bool = False,
              fake: dict[str, Format] | None = None) -> Iterator[nn.Module]:
        """Layer i holding its weights from the checkpoint for the duration of the block
        (released after it). `fake`: relative module path -> format, those weights quantized
        and dequantized (from their stored dtype, as the variant will compute); `float32`:
        every floating weight cast to float32 (the stored copies are not kept)."""
        layer = self.layers[i]
        flat = self.layer_weights(i)
        for rel, fmt in (fake or {}).items():
            flat[f"{rel}.weight"] = fake_quantize(flat[f"{rel}.weight"], fmt)
        if float32:
            flat = {k: _f32(v) for k, v in flat.items()}
        placeholders = layer.parameters()
        layer.update(tree_unflatten(list(flat.items())))
        del flat
        swapped = float32_linears(layer) if float32 else []
        try:
            yield layer
        finally:
            for path, module in swapped:
                _set_child(layer, path, module)
            layer.update(placeholders)

    def rows(self, path: str) -> Rows | mx.array:
        """The weight of an outer tensor (embedding, untied head) by rows: read from the file
        through a memory map when it is stored as is, else the (small) fresh array."""
        name = f"{path}.weight"
        src = self._sources.get(name)
        return self.checkpoint.rows(src) if src is not None else self.outer_weights[name]

    # ------------------------------------------------------------------ naming
    def layer_path(self, i: int) -> str:
        return f"{self.prefix}.layers.{i}"

    def layer_tensors(self, i: int) -> dict[str, nn.Module]:
        """Full path -> quantizable module of layer i (weights: shapes only, see `layer`)."""
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
        """Embeddings of token rows in float32 (the table's rows read by token); with `fmt`, as
        that quantization of the table would give them (groups run along a row, so the
        looked-up rows quantize alone)."""
        picked = self.rows(f"{self.prefix}.embed_tokens")[rows.reshape(-1)]
        if fmt is not None and fmt.bits != 16:
            picked = fake_quantize(picked, fmt)
        return picked.reshape(*rows.shape, -1).astype(mx.float32)

    @contextmanager
    def float32(self, module: nn.Module) -> Iterator[nn.Module]:
        """The module with float32 copies of its vectors (norms, biases; matrices are made
        float32 at their call, `Float32Linear`), for the duration of the block."""
        saved = module.parameters()
        module.update(tree_map(_f32, saved))
        try:
            yield module
        finally:
            module.update(saved)

    def run_layer(self, i: int, h: mx.array, record: dict | None = None,
                  fake: dict[str, Format] | None = None) -> mx.array:
        """Layer i, read from the checkpoint, on hidden states h (float32); with `record`, each
        quantizable module's input statistics are added to it under the module's full path;
        `fake`: modules (relative paths) run quantized at these formats."""
        with self.layer(i, float32=True, fake=fake) as layer:
            return self.apply(i, layer, h, record)

    def apply(self, i: int, layer: nn.Module, h: mx.array, record: dict | None = None) -> mx.array:
        """Layer i as it holds its weights now, computed in float32 (its linears through
        `Float32Linear`, its vectors cast for the call where they are not float32 yet)."""
        fa_mask, ssm_mask = self.masks(h)
        mask = ssm_mask if layer.is_linear else fa_mask
        swapped = float32_linears(layer)  # (a layer read in float32 has them already)
        if record is not None:
            base = self.layer_path(i)
            for rel in quantizable(layer):
                module = _get_child(layer, rel)
                _set_child(layer, rel, Recorder(module, record, f"{base}.{rel}"))
                swapped.append((rel, module))
        cast = any(_f32(v).dtype != v.dtype for _, v in tree_flatten(layer.parameters()))
        try:
            if cast:
                with self.float32(layer):
                    out = layer(h, mask=mask, cache=None)
                    mx.eval(out, *(v[0] for v in (record or {}).values()))
            else:
                out = layer(h, mask=mask, cache=None)
                mx.eval(out, *(v[0] for v in (record or {}).values()))
        finally:
            for rel, module in reversed(swapped):
                _set_child(layer, rel, module)
        return out

    def final_norm(self, h: mx.array) -> mx.array:
        w = self.outer_weights[f"{self.prefix}.norm.weight"]
        out = mx.fast.rms_norm(h, w.astype(mx.float32), self.text.norm.eps)
        mx.eval(out)
        return out

    @property
    def head_chunk_rows(self) -> int:
        width = int(self.text.embed_tokens.weight.shape[-1])
        return max(1024, min(HEAD_CHUNK, HEAD_CHUNK_BYTES // (4 * width)))

    def head_weight(self) -> Rows | mx.array:
        """The head's weight, read by row chunks (the embedding table when tied)."""
        return self.rows(self.head_path)

    def token_chunk(self) -> int:
        """Tokens whose [tokens, vocabulary] float32 rows take about REF_CHUNK_BYTES."""
        return max(16, REF_CHUNK_BYTES // (4 * self.vocab))

    def logprobs(self, normed: mx.array, weight=None) -> mx.array:
        """log-softmax of the head over normed hidden states [T, hidden] (float32). The head is
        read once per token chunk (`weight` replaces it, e.g. a quantized one read chunk by
        chunk) and the normaliser accumulated over its chunks: memory is the result, its
        logits, and one chunk of the head."""
        out = []
        for s in range(0, normed.shape[0], self.token_chunk()):
            parts, lse = [], _OnlineLogSumExp()
            rows = normed[s:s + self.token_chunk()]
            w = self.head_weight() if weight is None else weight
            for start in range(0, w.shape[0], self.head_chunk_rows):  # each chunk read once
                z = rows @ w[start:start + self.head_chunk_rows].astype(mx.float32).T
                lse.add(z)
                parts.append(z)
            norm = lse.value()
            out.append(mx.concatenate([p - norm for p in parts], axis=-1))
            del parts
            mx.eval(out[-1])
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def compare(self, ref: mx.array, normed: mx.array, weight=None) -> tuple[mx.array, mx.array]:
        """Per position: KL(ref || head(normed)) and whether the top tokens agree, a token chunk
        (REF_CHUNK_BYTES of log-probabilities) at a time (`ref`: reference log-probabilities).
        KL is summed as sum p (log p - log q) from the two log-probabilities: the algebraically
        equal sum p log p - sum p z + logsumexp(z) over raw logits loses the small KLDs of a probe
        to float32 cancellation (the embedded model: -1.9e-4 for a true 3.1e-5)."""
        klds, same = [], []
        for s in range(0, normed.shape[0], self.token_chunk()):
            got = self.logprobs(normed[s:s + self.token_chunk()], weight)
            r = ref[s:s + self.token_chunk()]
            klds.append(kld_rows(r, got))
            same.append(r.argmax(-1) == got.argmax(-1))
            mx.eval(klds[-1], same[-1])
            del got
        return mx.concatenate(klds), mx.concatenate(same)


class _OnlineLogSumExp:
    """logsumexp over the last axis of logits that arrive in column chunks."""

    def __init__(self):
        self.m = self.s = None

    def add(self, z: mx.array) -> None:
        top = z.max(axis=-1, keepdims=True)
        m = top if self.m is None else mx.maximum(self.m, top)
        s = mx.exp(z - m).sum(axis=-1, keepdims=True)
        self.s = s if self.s is None else s + self.s * mx.exp(self.m - m)
        self.m = m
        mx.eval(self.m, self.s)

    def value(self) -> mx.array:
        return self.m + mx.log(self.s)


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
