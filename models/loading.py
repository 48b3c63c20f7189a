"""Loading a resolved checkpoint with mlx-lm's own loader, in the compute dtype for the backend.

On CPU, MLX runs float32 far faster than bfloat16 (quantized_matmul with bf16 activations was
~10x slower than with fp32 activations and scales; see shared/scoping-facts.md and
`tests/bench/dtype_bench.py`), so "auto" means float32 on CPU and the checkpoint's dtype on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .registry import ResolvedModel

DTYPES = ("auto", "float32", "bfloat16", "float16")


def compute_dtype(name: str = "auto"):
    import mlx.core as mx

    if name not in DTYPES:
        raise ValueError(f"compute dtype {name!r}: allowed {', '.join(DTYPES)}")
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, name)


@dataclass
class LoadedModel:
    model: Any  # mlx_lm model (nn.Module)
    tokenizer: Any  # mlx_lm TokenizerWrapper
    resolved: ResolvedModel
    config: dict

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


def load(resolved: ResolvedModel, dtype: str = "auto", path=None, group=None,
         dequantize: bool = False) -> LoadedModel:
    """Loads `resolved` (or `path`, a variant of it such as a quantized copy) with mlx-lm.
    With a distributed `group` of size > 1, mlx-lm's tensor-parallel sharding splits the
    model across the group's ranks (each holds its slice). `dequantize`: quantized layers
    become dense ones with the dequantized weights (the same function up to rounding), for
    teacher-forced evaluation on CPU, where dense float32 matmuls use BLAS and long prompts
    through quantized kernels are slow."""
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load

    from . import gated_delta_chunked
    from .registry import read_config

    gated_delta_chunked.install()  # chunk-parallel GatedDeltaNet prefill where no Metal kernel runs
    folder = path or resolved.path
    if group is not None and group.size() > 1:
        from mlx_lm.utils import sharded_load

        model, tokenizer = sharded_load(str(folder), tensor_group=group)
    else:
        model, tokenizer = mlx_load(str(folder))
    if dequantize:
        _dequantize(model)
    target = compute_dtype(dtype)
    if target is not None:
        # Cast floating weights (scales and biases of quantized layers too); integer packed
        # weights stay as they are.
        model.set_dtype(target, lambda d: mx.issubdtype(d, mx.floating))
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, resolved=resolved,
                       config=read_config(folder))


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                enable_thinking: bool = False, add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text through the checkpoint's own chat template (as transformers renders it)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking, **kwargs)


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` block."""
    tail = prompt.rstrip()
    return tail.endswith("<think>")


def _dequantize(model) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size,
                              bits=m.bits, mode=getattr(m, "mode", "affine"))
            if isinstance(m, nn.QuantizedLinear):
                dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    dense.bias = m.bias
            else:
                dense = nn.Embedding(w.shape[0], w.shape[1])
            dense.weight = w
            swaps.append((path, dense))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
