"""Loading a resolved checkpoint with mlx-lm's own loader, in the compute dtype for the backend.

On CPU, MLX runs float32 far faster than bfloat16 (quantized_matmul with bf16 activations was
~10x slower than with fp32 activations and scales; see shared/scoping-facts.md and
`tests/bench/dtype_bench.py`), so "auto" means float32 on CPU and the checkpoint's dtype on GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .registry import ResolvedModel

log = logging.getLogger("mixbit.models")

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
    cpu_plan: dict | None = None  # how each projection runs on the CPU (models/kernels.serve)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


CPU_QUANTIZED = ("auto", "dense", "packed", "mlx")


def load(resolved: ResolvedModel, dtype: str = "auto", path=None, group=None,
         dequantize: bool = False, cpu_quantized: str = "auto", cpu_activations: str = "auto") -> LoadedModel:
    """Loads `resolved` (or `path`, a variant of it such as a quantized copy) with mlx-lm.
    With a distributed `group` of size > 1, mlx-lm's tensor-parallel sharding splits the
    model across the group's ranks (each holds its slice). `dequantize`: quantized layers
    become dense ones with the dequantized weights (the same function up to rounding).

    `cpu_quantized` says how quantized (and bfloat16) projections run on CPU: "packed" on
    mixbit's kernels over the packed weights (models/kernels: the variant served from its own
    bytes); "dense" dequantized to float32 once at load; "mlx" through MLX's quantized_matmul
    with prompts through a transient dequantized copy (`cpu_quantized_prefill`; its cost grows
    with every row: a 512-token prefill of the embedded mixbit-auto took 2.1 s, 0.16 s dense);
    "auto" decides per layer shape by timing both here (`kernels.serve`), and without the
    kernels is dense when that takes at most a quarter of physical memory, else "mlx". Every
    way the served function is the quantized one. `cpu_activations` (kernels.ACTIVATIONS): whether
    the packed kernels take their activations as 16-bit integers per group (and the engine's
    prefill as 8-bit ones) where that measured faster ("auto"), always ("int16"; "int8" with the
    8-bit prefill) or never ("float32")."""
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load

    from . import gated_delta_chunked
    from .registry import read_config

    if cpu_quantized not in CPU_QUANTIZED:
        raise ValueError(f"cpu_quantized {cpu_quantized!r}: allowed {', '.join(CPU_QUANTIZED)}")
    gated_delta_chunked.install()  # chunk-parallel GatedDeltaNet prefill where no Metal kernel runs
    folder = path or resolved.path
    sharded = group is not None and group.size() > 1
    if sharded:
        from mlx_lm.utils import sharded_load

        model, tokenizer = sharded_load(str(folder), tensor_group=group)
    else:
        model, tokenizer = mlx_load(str(folder))
    release_tokenizer_scratch(tokenizer._tokenizer)
    target = compute_dtype(dtype)
    plan = None
    cpu = mx.default_device() == mx.cpu and not sharded and not dequantize
    use_kernels = cpu and cpu_quantized in ("auto", "packed") and kernels_available()
    if cpu and cpu_quantized == "packed" and not use_kernels:
        log.warning("CPU: no packed kernels (%s); quantized layers run on MLX's kernels",
                    _kernels_error())
    keep = _bf16_projections(model) if use_kernels else {}
    if target is not None:
        # Cast floating weights (scales and biases of quantized layers too); integer packed
        # weights stay as they are. bfloat16 projections the kernels read are put back below.
        model.set_dtype(target, lambda d: mx.issubdtype(d, mx.floating))
    if dequantize:
        _dequantize(model)
    elif use_kernels:
        from . import kernels

        plan = summary = kernels.serve(model, cpu_quantized, dense_budget=_physical_memory() // 4,
                                       restore=keep, activations=cpu_activations)
        log.info("CPU kernels (%s, %d threads): %d projections served packed, %d dense float32 "
                 "(%.1f MB) where that measured faster for one decode row",
                 kernels.info().get("isa"), kernels.threads(), summary["packed"], summary["dense"],
                 summary["dense_bytes"] / 1e6)
        for row in summary["shapes"]:
            log.debug("CPU kernels: %s", row)
    elif cpu:
        dense_bytes = _dense_bytes(model)
        if dense_bytes and (cpu_quantized == "dense" or
                            (cpu_quantized == "auto" and dense_bytes <= _physical_memory() // 4)):
            _dequantize(model)
            log.info("CPU: quantized layers dequantized once at load (about %.1f MB dense; "
                     "MLX's CPU quantized kernels are slow past one row)", dense_bytes / 1e6)
        elif dense_bytes:
            n = cpu_quantized_prefill(model)
            log.info("CPU: %d quantized layers kept packed; prompts multiply through a transient "
                     "dequantized weight (no packed CPU kernels: %s)", n, _kernels_error())
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, resolved=resolved,
                       config=read_config(folder), cpu_plan=plan)


# transformers 5 tokenizer classes that build their Rust tokenizer from a vocabulary dict and a
# merges list kept as `_vocab` and `_merges`, and never read either after __init__ (checked in
# their source; some other classes do read theirs, e.g. Whisper's save_vocabulary).
_SCRATCH_AFTER_INIT = ("Qwen2Tokenizer", "Qwen3_5Tokenizer")


def release_tokenizer_scratch(hf_tokenizer) -> None:
    """Drops the Python copies of the vocabulary and merges a Qwen tokenizer was built from: the
    Rust tokenizer holds its own, and at Qwen3.5's 248k-token vocabulary these copies were
    ~130 MB of Python objects (a third of a 0.8B 4-bit variant's bytes) kept for the life of the
    server. Deleted rather than emptied, so a transformers that starts reading them fails loudly
    in the tests instead of tokenizing from an empty vocabulary."""
    if type(hf_tokenizer).__name__ in _SCRATCH_AFTER_INIT:
        for name in ("_vocab", "_merges"):
            if isinstance(getattr(hf_tokenizer, name, None), (dict, list)):
                delattr(hf_tokenizer, name)


def kernels_available() -> bool:
    from . import kernels

    return kernels.available()


def _kernels_error() -> str:
    from . import kernels

    return kernels.IMPORT_ERROR or "not used"


def _bf16_projections(model) -> dict:
    """bfloat16 weights of Linear and Embedding layers, by module path, before the cast."""
    import mlx.core as mx
    import mlx.nn as nn

    return {path: m.weight for path, m in model.named_modules()
            if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.bfloat16}


def _dense_bytes(model) -> int:
    """Bytes (float32) the quantized layers would take dense (0: nothing is quantized)."""
    import mlx.nn as nn

    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += m["weight"].shape[0] * m["weight"].shape[1] * 32 * 4 // m.bits
    return total


def _physical_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


# Rows (tokens in the call) from which a packed quantized layer on CPU dequantizes its weight for
# the call and multiplies through BLAS instead of MLX's CPU quantized_matmul, whose cost grows
# with every row. `tests/bench/qmm_bench.py` (4-bit group 64, float32): one layer alone crosses
# over at 2-8 rows, but in whole decode steps of the embedded model the per-call dequantization
# (fresh float32 weights every step) made batch 4 and 8 slower than the kernels (36 vs 20 and
# 37 ms) and won from 16 rows (38 vs 68 ms); a 512-token prefill takes 0.18 s instead of 2.1 s.
DENSE_ROWS = 16


def cpu_quantized_prefill(model) -> int:
    """On CPU, quantized layers keep their packed weights (the memory saving) but multiply
    prompts, and decode batches past the crossover, through a transient dequantized copy: the
    same function (dequantize is what the kernel computes), at BLAS speed. Returns how many
    layers were switched. Metal's kernels need none of this."""
    import mlx.core as mx
    import mlx.nn as nn

    def dense_matmul(layer, x):  # what quantized_matmul computes, through BLAS
        w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"),
                          group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        return mx.matmul(x, w.T)

    class _Linear(nn.QuantizedLinear):
        def __call__(self, x):
            if x.size // x.shape[-1] >= self._dense_rows:
                x = dense_matmul(self, x)
                return x + self["bias"] if "bias" in self else x
            return super().__call__(x)

    class _Embedding(nn.QuantizedEmbedding):
        def as_linear(self, x):  # a tied output head
            if x.size // x.shape[-1] >= self._dense_rows:
                return dense_matmul(self, x)
            return super().as_linear(x)

    switched = 0
    for _, module in model.named_modules():
        kind = {nn.QuantizedLinear: _Linear, nn.QuantizedEmbedding: _Embedding}.get(type(module))
        if kind is None:  # sharded or other quantized layers keep their own kernels
            continue
        module.__class__ = kind
        module._dense_rows = DENSE_ROWS
        switched += 1
    return switched


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
