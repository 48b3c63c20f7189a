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
            return self.model(self.rows)
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
