"""Per-tensor sensitivity: quantize one tensor alone, keep the rest bf16, measure the KL divergence
of next-token distributions against the unquantized model on calibration tokens.

For the qwen3_5 family the forward pass is resumed from the layer that holds the perturbed tensor
(hidden states entering every layer are computed once), which roughly halves the cost. Every
(tensor, bits) pair is measured at group size 64; other group sizes of the same bits are
estimated from the measured value scaled by the ratio of activation-weighted reconstruction
errors, and marked as estimated in the table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mixbit.models.forward import score

from .calibration import CalibrationSet
from .formats import BITS, Format, fake_quantize, formats_for, quantizable, tensor_class

MEASURE_GROUP = 64


def kl_divergence(ref_logprobs: mx.array, logits: mx.array) -> mx.array:
    """Mean over positions of KL(ref || model), in nats; both [..., vocab]."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    return (mx.exp(ref_logprobs) * (ref_logprobs - lp)).sum(axis=-1).mean()


class Runner:
    """Forward passes that can start at any decoder layer of a qwen3_5-style model."""

    def __init__(self, model: nn.Module, rows: mx.array):
        self.model = model
        lm = getattr(model, "language_model", model)
        self.text = lm.model if hasattr(lm, "model") else None
        self.lm = lm
        self.rows = rows
        self.layered = self.text is not None and hasattr(self.text, "layers") and all(
            hasattr(layer, "is_linear") for layer in self.text.layers)
        self.cache_inputs()

    def _masks(self, h):
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        return create_attention_mask(h, None), create_ssm_mask(h, None)

    def cache_inputs(self) -> None:
        if not self.layered:
            return
        h = self.text.embed_tokens(self.rows)
        self.fa_mask, self.ssm_mask = self._masks(h)
        self.inputs = [h]
        for layer in self.text.layers:
            h = layer(h, mask=self.ssm_mask if layer.is_linear else self.fa_mask, cache=None)
            mx.eval(h)
            self.inputs.append(h)

    def logits(self, start_layer: int = 0) -> mx.array:
        if not self.layered or start_layer <= 0:
            return score(self.model, self.rows)
        start = min(start_layer, len(self.text.layers))
        h = self.inputs[start]
        for layer in self.text.layers[start:]:
            h = layer(h, mask=self.ssm_mask if layer.is_linear else self.fa_mask, cache=None)
        out = self.text.norm(h)
        if getattr(self.lm.args, "tie_word_embeddings", False):
            return self.text.embed_tokens.as_linear(out)
        return self.lm.lm_head(out)


def layer_of(path: str) -> int:
    parts = path.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    if path.endswith("lm_head"):
        return 10 ** 6  # only the head: resume after the last layer
    return 0  # embeddings: everything changes


@dataclass
class SensitivityTable:
    """kld[path][format name] in nats/token; `estimated` lists the entries not measured."""
    kld: dict[str, dict[str, float]]
    params: dict[str, int]
    shapes: dict[str, list[int]]
    estimated: dict[str, list[str]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kld": self.kld, "params": self.params, "shapes": self.shapes,
                "estimated": self.estimated, "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> "SensitivityTable":
        return cls(kld=data["kld"], params=data["params"], shapes=data["shapes"],
                   estimated=data.get("estimated", {}), meta=data.get("meta", {}))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        tmp.replace(path)

    def ranking(self, fmt: str = "q3g64") -> list[tuple[str, float]]:
        return sorted(((p, v[fmt]) for p, v in self.kld.items() if fmt in v), key=lambda x: -x[1])

    def class_ranking(self, fmt: str = "q3g64") -> list[tuple[str, float]]:
        """Tensor classes (e.g. linear_attn.out_proj) by their mean KLD over layers."""
        sums: dict[str, list[float]] = {}
        for p, v in self.kld.items():
            if fmt in v:
                sums.setdefault(tensor_class(p), []).append(v[fmt])
        return sorted(((c, sum(x) / len(x)) for c, x in sums.items()), key=lambda x: -x[1])


def recon_error(w: mx.array, fmt: Format) -> float:
    return float(((w.astype(mx.float32) - fake_quantize(w, fmt).astype(mx.float32)) ** 2).mean().item())


def measure(model: nn.Module, calib: CalibrationSet, bits: tuple[int, ...] = BITS,
            progress: Callable[[int, int, str], None] | None = None) -> SensitivityTable:
    runner = Runner(model, calib.rows)
    ref = runner.logits(0).astype(mx.float32)
    ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    mx.eval(ref)
    modules = quantizable(model)
    table = SensitivityTable(kld={}, params={}, shapes={})
    todo = [(p, b) for p in modules for b in bits]
    started = time.time()
    for i, (path, b) in enumerate(todo):
        module = modules[path]
        w = module.weight
        if path not in table.kld:
            table.kld[path], table.estimated[path] = {}, []
            table.params[path] = int(w.size)
            table.shapes[path] = list(w.shape)
        fmt = Format(b, MEASURE_GROUP if w.shape[-1] % MEASURE_GROUP == 0 else 32)
        module.weight = fake_quantize(w, fmt)
        kl = kl_divergence(ref, runner.logits(layer_of(path)))
        table.kld[path][fmt.name] = max(0.0, float(kl.item()))
        module.weight = w
        # other group sizes of these bits: scaled by reconstruction error (cheap, no forward)
        base_err = recon_error(w, fmt)
        for other in formats_for(w.shape[-1]):
            if other.bits != b or other == fmt:
                continue
            ratio = recon_error(w, other) / base_err if base_err > 0 else 1.0
            table.kld[path][other.name] = table.kld[path][fmt.name] * ratio
            table.estimated[path].append(other.name)
        if progress:
            progress(i + 1, len(todo), path)
    table.meta = {"calibration": calib.provenance, "seconds": round(time.time() - started, 1),
                  "measured_group_size": MEASURE_GROUP, "bits": list(bits),
                  "method": "one tensor fake-quantized at a time, KL(bf16 || quantized) per token"}
    return table


def fisher_estimate(model: nn.Module, calib: CalibrationSet, bits: tuple[int, ...] = BITS,
                    samples: int = 1, seed: int = 0,
                    progress: Callable[[int, int, str], None] | None = None) -> SensitivityTable:
    """The cheap estimator for models too big to ablate tensor by tensor.

    Second-order view of the ablation: KL(p || p_dW) ~ 1/2 dW^T F dW, with F the Fisher
    information of the model's own predictive distribution. Its diagonal is estimated from
    squared gradients of log p(y|x) with y drawn from the model (one backward pass per row and
    sample), so the cost is a few backward passes instead of a forward pass per (tensor,
    format). Each (tensor, format) then costs one fake-quantization: sum(F * (W - Q(W))^2) / 2.
    """
    from mixbit.models.forward.layers import TRAIN, is_packed

    modules = quantizable(model)
    on_kernels = [p for p, m in model.named_modules() if is_packed(m)]
    if on_kernels:
        raise ValueError(f"fisher_estimate needs gradients, and {on_kernels[0]} (with "
                         f"{len(on_kernels) - 1} more) runs on mixbit's CPU kernels, which are "
                         "forward-only: load the model with cpu_quantized='dense'")
    key = mx.random.key(seed)
    fisher = {p: mx.zeros(m.weight.shape, dtype=mx.float32) for p, m in modules.items()}
    started = time.time()

    def nll(params, rows, targets):
        model.update(params)
        logits = model(rows, phase=TRAIN).astype(mx.float32)  # differentiable MLX ops only
        return nn.losses.cross_entropy(logits, targets, reduction="sum")

    params = model.trainable_parameters()
    grad_fn = mx.grad(nll)
    n_rows = calib.rows.shape[0]
    _accumulate_fisher(model, calib, modules, fisher, grad_fn, params, samples, key, progress)
    model.update(params)
    tokens = n_rows * calib.rows.shape[1] * samples
    table = SensitivityTable(kld={}, params={}, shapes={})
    for path, module in modules.items():
        w = module.weight
        f = fisher[path] / tokens
        table.kld[path], table.estimated[path] = {}, []
        table.params[path], table.shapes[path] = int(w.size), list(w.shape)
        for fmt in formats_for(w.shape[-1]):
            if fmt.bits not in bits:
                continue
            dw = w.astype(mx.float32) - fake_quantize(w, fmt).astype(mx.float32)
            table.kld[path][fmt.name] = 0.5 * float((f * dw * dw).sum().item())
            table.estimated[path].append(fmt.name)
    table.meta = {"calibration": calib.provenance, "seconds": round(time.time() - started, 1),
                  "bits": list(bits), "samples": samples,
                  "method": "diagonal Fisher (squared gradients of log p(y|x), y sampled from the "
                            "model) times squared quantization error, halved"}
    return table


def _accumulate_fisher(model, calib, modules, fisher, grad_fn, params, samples, key, progress):
    from mlx.utils import tree_flatten

    n_rows = calib.rows.shape[0]
    for i in range(n_rows):
        row = calib.rows[i:i + 1]
        logits = model(row, phase="score").astype(mx.float32)
        for _ in range(samples):
            key, sub = mx.random.split(key)
            targets = mx.random.categorical(logits, key=sub)
            grads = dict(tree_flatten(grad_fn(params, row, targets)))
            for p in modules:
                g = grads.get(p + ".weight")
                if g is not None:
                    fisher[p] = fisher[p] + g.astype(mx.float32) ** 2
            mx.eval(fisher)
        if progress:
            progress(i + 1, n_rows, "fisher")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: SensitivityTable, b: SensitivityTable, fmt: str | None = None) -> tuple[float, int]:
    """Spearman's rho between two tables over the (tensor, format) pairs both have (one format
    when `fmt` is given, e.g. "q4g64" to compare tensor rankings at 4 bits)."""
    pairs = [(a.kld[p][f], b.kld[p][f]) for p in a.kld if p in b.kld for f in a.kld[p]
             if f in b.kld[p] and (fmt is None or f == fmt) and f not in a.estimated.get(p, [])]
    if len(pairs) < 3:
        return float("nan"), len(pairs)
    ra, rb = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    n = len(pairs)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return (cov / var if var else float("nan")), n
