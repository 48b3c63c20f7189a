"""Activation-aware weight quantization (AWQ) for Qwen3.5, folded into the RMSNorms.

For every projection group fed by one RMSNorm (self_attn q/k/v, linear_attn in_proj_qkv/z/b/a,
mlp gate/up) a per-input-channel scale s = mean|x|^alpha is searched on calibration activations:
the weights are multiplied by s before quantizing and the norm's weight is divided by s, so the
unquantized function is unchanged and inference costs nothing extra. `o_proj`, `out_proj` and
`down_proj` have no norm to fold into and are left alone. Norm weights are handled in MLX's own
convention (after mlx-lm's sanitize has added Qwen3.5's +1, the weight is the multiplier itself).
mlx-lm 0.32's AWQ refuses qwen3_5 ("NYI"); its scale search idea is reused here, not its code.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .formats import Format, fake_quantize

ALPHAS = tuple(i / 10 for i in range(11))
# multiply-adds of one candidate's error, at most: every row of the embedded model's groups, every
# k-th row at real widths (the 9B's in_proj group: ~600 of 12,352 rows, each over 2,048 tokens; the
# candidates are compared on the same rows)
SEARCH_MACS = 6 << 30


@dataclass
class GroupResult:
    layer: int
    norm: str
    members: list[str]
    alpha: float
    error_before: float
    error_after: float


def _groups(layer) -> list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]:
    """(norm name, norm, [(member name, linear)]) for one decoder layer."""
    out = []
    if getattr(layer, "is_linear", False):
        la = layer.linear_attn
        out.append(("input_layernorm", layer.input_layernorm,
                    [(f"linear_attn.{n}", getattr(la, n)) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]))
    else:
        sa = layer.self_attn
        out.append(("input_layernorm", layer.input_layernorm,
                    [(f"self_attn.{n}", getattr(sa, n)) for n in ("q_proj", "k_proj", "v_proj")]))
    mlp = layer.mlp
    if hasattr(mlp, "gate_proj"):
        out.append(("post_attention_layernorm", layer.post_attention_layernorm,
                    [("mlp.gate_proj", mlp.gate_proj), ("mlp.up_proj", mlp.up_proj)]))
    return out


def _error(x: mx.array, members: list[tuple[mx.array, Format]], s: mx.array | None) -> float:
    total = mx.array(0.0)
    for w, fmt in members:
        if s is None:
            wq = fake_quantize(w, fmt)
        else:
            wq = fake_quantize(w * s, fmt) / s
        diff = x @ (w - wq).T
        total = total + (diff * diff).mean()
    return float(total.item())


def group_inputs(layer, h: mx.array, output: bool = False):
    """The input of each norm-fed projection group of one layer, from the layer's input h; with
    `output`, (those, the layer's output): the layer's own steps, its attention computed once."""
    mask_fa, mask_ssm = _masks(h)
    mask = mask_ssm if layer.is_linear else mask_fa
    attn = layer.linear_attn if layer.is_linear else layer.self_attn
    out = {"input_layernorm": layer.input_layernorm(h)}
    after_attn = h + attn(out["input_layernorm"], mask, None)
    out["post_attention_layernorm"] = layer.post_attention_layernorm(after_attn)
    if not output:
        mx.eval(out)
        return out
    nxt = after_attn + layer.mlp(out["post_attention_layernorm"])
    mx.eval(out, nxt)
    return out, nxt


def _masks(h):
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    return create_attention_mask(h, None), create_ssm_mask(h, None)


def awq_layer(i: int, layer, inputs: dict[str, mx.array], plan: dict[str, Format], base: str,
              max_tokens: int = 2048) -> list[GroupResult]:
    """Searches and folds AWQ scales into one layer's norms, in place, from the inputs of its
    norm-fed groups (`group_inputs`). `plan` maps full module paths to formats."""
    results = []
    for norm_name, norm, members in _groups(layer):
        quantized = [(lin, plan[f"{base}.layers.{i}.{name}"]) for name, lin in members
                     if plan.get(f"{base}.layers.{i}.{name}", Format(16)).bits != 16]
        if not quantized:
            continue
        x = inputs[norm_name]
        x = x.reshape(-1, x.shape[-1]).astype(mx.float32)[:max_tokens]
        # the output error of every k-th row (rows quantize independently; the scale is per
        # input channel): the search costs at most SEARCH_MACS per candidate at any width
        rows = sum(lin.weight.shape[0] for lin, _ in quantized)
        stride = max(1, -(-x.shape[0] * x.shape[1] * rows // SEARCH_MACS))
        quantized = [(lin.weight[::stride].astype(mx.float32), fmt) for lin, fmt in quantized]
        mx.eval(quantized)
        mean_abs = mx.maximum(mx.abs(x).mean(axis=0), 1e-6)
        before = _error(x, quantized, None)
        best = (before, 0.0, None)
        for alpha in ALPHAS[1:]:
            s = mean_abs ** alpha
            s = s / mx.sqrt(s.max() * s.min())
            err = _error(x, quantized, s)
            if err < best[0]:
                best = (err, alpha, s)
        if best[2] is not None:
            s = best[2]
            norm.weight = (norm.weight.astype(mx.float32) / s).astype(norm.weight.dtype)
            for _, lin in members:  # every consumer of the norm, quantized or not
                lin.weight = (lin.weight.astype(mx.float32) * s).astype(lin.weight.dtype)
        results.append(GroupResult(layer=i, norm=norm_name, members=[n for n, _ in members],
                                   alpha=best[1], error_before=before, error_after=best[0]))
    return results


def apply_awq(model: nn.Module, rows: mx.array, plan: dict[str, Format], prefix: str = "",
              max_tokens: int = 2048) -> list[GroupResult]:
    """Searches and folds AWQ scales in place for the groups whose members `plan` quantizes,
    over a model held in memory (the streamed writer calls `awq_layer` layer by layer).

    `plan` maps module paths (as `quantizable()` names them) to formats; `rows` are calibration
    token ids. Returns what was done per group."""
    lm = getattr(model, "language_model", model)
    text = lm.model
    base = prefix or ("language_model.model" if hasattr(model, "language_model") else "model")
    h = text.embed_tokens(rows).astype(mx.float32)
    fa_mask, ssm_mask = _masks(h)
    results = []
    for i, layer in enumerate(text.layers):
        results += awq_layer(i, layer, group_inputs(layer, h), plan, base, max_tokens)
        h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=None)
        mx.eval(h)
    return results
