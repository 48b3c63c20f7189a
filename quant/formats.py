"""Quantization formats, their sizes, and the tensors of a model they apply to."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
SCALE_BYTES = 2  # MLX stores per-group scale and bias in the model's float dtype (bf16 on disk)


@dataclass(frozen=True, order=True)
class Format:
    """bits = 16 means the tensor stays in bfloat16."""
    bits: int
    group_size: int = 0

    @property
    def name(self) -> str:
        return "bf16" if self.bits == 16 else f"q{self.bits}g{self.group_size}"

    @classmethod
    def parse(cls, name: str) -> "Format":
        if name == "bf16":
            return BF16
        bits, group = name[1:].split("g")
        return cls(int(bits), int(group))

    def bits_per_weight(self) -> float:
        if self.bits == 16:
            return 16.0
        return self.bits + 8.0 * 2 * SCALE_BYTES / self.group_size

    def nbytes(self, n_out: int, n_in: int) -> float:
        return n_out * n_in * self.bits_per_weight() / 8


BF16 = Format(16, 0)


def formats_for(n_in: int) -> list[Format]:
    """MLX quantizes a weight when its input dimension divides by the group size."""
    return [Format(b, g) for b in BITS for g in GROUPS if n_in % g == 0]


def _quantizable_types() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import SwitchLinear  # MoE experts, stacked [experts, out, in]

    return (nn.Linear, nn.Embedding, SwitchLinear)


def quantizable(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> module for every Linear / Embedding / stacked-expert linear whose weight MLX can
    quantize."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, _quantizable_types()) and not isinstance(
                module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and "weight" in module:
            if module.weight.shape[-1] % min(GROUPS) == 0:
                out[path] = module
    return dict(sorted(out.items()))


def rows_and_width(shape) -> tuple[int, int]:
    """(rows, input width) of a weight of any rank: [out, in] or [experts, out, in]."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, int(shape[-1])


def is_gate(path: str) -> bool:
    """An MoE router or shared-expert gate: tiny, and every token's routing depends on it."""
    return path.endswith("mlp.gate") or path.endswith("shared_expert_gate")


GATE_FORMAT_BITS = 8  # routers and gates never below this


def fake_quantize(w: mx.array, fmt: Format) -> mx.array:
    """The weight as the quantized layer will see it (quantize, then dequantize)."""
    if fmt.bits == 16:
        return w.astype(mx.bfloat16).astype(w.dtype)
    if w.ndim == 3 and w.shape[0] > 8 and w.size > (1 << 26):  # 256 stacked experts: by chunks
        step = max(1, (1 << 26) // (w.shape[1] * w.shape[2]))
        return mx.concatenate([fake_quantize(w[s:s + step], fmt) for s in range(0, w.shape[0], step)])
    q, scales, biases = mx.quantize(w, group_size=fmt.group_size, bits=fmt.bits)
    return mx.dequantize(q, scales, biases, group_size=fmt.group_size, bits=fmt.bits).astype(w.dtype)


def tensor_class(path: str) -> str:
    """'language_model.model.layers.3.linear_attn.out_proj' -> 'linear_attn.out_proj'."""
    parts = path.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[i + 2:])
    return parts[-1]
