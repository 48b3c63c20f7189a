"""`ensure_variant`: the one door between a model source and what the server loads.

Given a resolved checkpoint and a recipe, returns the folder to serve. Today the only recipe is
"bf16" (serve the checkpoint as it is) and a checkpoint that is already an MLX quantized one is
served as it is whatever the recipe; the quantization issue adds the mixed-bit recipes behind
this same function (measure -> allocate -> AWQ -> write atomically -> verify -> cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mixbit.models.registry import ResolvedModel

RECIPES = ("bf16",)


@dataclass(frozen=True)
class Variant:
    path: Path  # folder mlx-lm loads
    recipe: str
    source: ResolvedModel
    manifest: dict  # provenance shown in /v1/models


def ensure_variant(resolved: ResolvedModel, recipe: str = "bf16", cache_dir: str | None = None,
                   progress: Callable[[str], None] | None = None) -> Variant:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; available: {', '.join(RECIPES)}")
    if resolved.quantized:
        # a community MLX quant or a `mixbit quantize --out` folder: served unchanged
        manifest = {"recipe": "as-is (already quantized)", "source": resolved.source}
        return Variant(path=resolved.path, recipe="as-is", source=resolved, manifest=manifest)
    if progress:
        progress(f"recipe {recipe}: serving {resolved.path} unquantized")
    return Variant(path=resolved.path, recipe=recipe, source=resolved,
                   manifest={"recipe": recipe, "source": resolved.source, "bits_per_weight": 16.0})
