"""Named recipes: a per-tensor format plan for a model.

- `uniform-4`, `uniform-3`: every quantizable tensor at 4 / 3 bits, group 64 (what community
  MLX quants do).
- `unsloth-static`: the published table for Qwen3.5 (MLP gate/up 3-bit, down 4-bit, q/k/v and
  in_proj 5-bit, linear_attn.out_proj and self_attn.o_proj bf16, embeddings 5-bit, lm_head 6-bit).
- `mixbit-auto`: sensitivity measured on the model at hand, then bits allocated under the
  `target_bpw` budget (see sensitivity.py and allocate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .formats import BF16, Format

RECIPES = ("bf16", "uniform-4", "uniform-3", "unsloth-static", "mixbit-auto")
# mixbit-auto's default budget: the size of uniform 4-bit group 64 (4.5 bits per weight), so the
# comparison users care about (same size as the 4-bit quants they use today) is the default.
DEFAULT_TARGET_BPW = 4.5

UNSLOTH_TABLE: list[tuple[str, Format]] = [
    (r"mlp\.(gate_proj|up_proj)$", Format(3, 64)),
    (r"mlp\.down_proj$", Format(4, 64)),
    (r"self_attn\.(q_proj|k_proj|v_proj)$", Format(5, 64)),
    (r"linear_attn\.in_proj_\w+$", Format(5, 64)),
    (r"linear_attn\.out_proj$", BF16),
    (r"self_attn\.o_proj$", BF16),
    (r"embed_tokens$", Format(5, 64)),
    (r"lm_head$", Format(6, 64)),
]


@dataclass
class Plan:
    formats: dict[str, Format]
    recipe: str
    target_bpw: float | None = None


def _fit(fmt: Format, n_in: int) -> Format:
    """A format MLX can apply to an input width (smaller groups when the width needs it)."""
    if fmt.bits == 16 or n_in % fmt.group_size == 0:
        return fmt
    for g in (64, 32):
        if n_in % g == 0:
            return Format(fmt.bits, g)
    return BF16


def static_plan(recipe: str, shapes: dict[str, list[int]]) -> Plan:
    formats: dict[str, Format] = {}
    tied = not any(p.endswith("lm_head") for p in shapes)
    for path, shape in shapes.items():
        if recipe == "uniform-4":
            fmt = Format(4, 64)
        elif recipe == "uniform-3":
            fmt = Format(3, 64)
        elif recipe == "unsloth-static":
            fmt = next((f for pattern, f in UNSLOTH_TABLE if re.search(pattern, path)), Format(4, 64))
            if tied and path.endswith("embed_tokens"):
                fmt = Format(6, 64)  # one table serves as embeddings and lm_head: the stricter rule
        else:
            raise ValueError(f"{recipe} is not a static recipe")
        formats[path] = _fit(fmt, shape[-1])
    return Plan(formats=formats, recipe=recipe)
