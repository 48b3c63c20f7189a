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


def load(resolved: ResolvedModel, dtype: str = "auto", path=None, group=None) -> LoadedModel:
    """Loads `resolved` (or `path`, a variant of it such as a quantized copy) with mlx-lm.
    With a distributed `group` of size > 1, mlx-lm's tensor-parallel sharding splits the
    model across the group's ranks (each holds its slice)."""
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
