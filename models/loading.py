"""Loading a resolved checkpoint through mlx-lm's public loader into mixbit's forward
(models/forward), built from its CPU plan, in the compute dtype for the backend; and its tokenizer.

On CPU, MLX runs float32 far faster than bfloat16 (quantized_matmul with bf16 activations was
~10x slower than with fp32 activations and scales; see shared/scoping-facts.md and
`tests/bench/dtype_bench.py`), so "auto" means float32 on CPU and the checkpoint's dtype on GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
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
    model: Any  # mixbit's Qwen3.5 (models/forward), or mlx-lm's model of another type
    tokenizer: Any  # mlx_lm TokenizerWrapper
    resolved: ResolvedModel
    config: dict
    cpu_plan: dict | None = None  # the plan's summary, for the log and /v1/models
    plan: Any = None  # the CPU plan the model was built from (models/forward/plan.CpuPlan)
    hf_tokenizer: Any = None  # the transformers tokenizer inside `tokenizer`

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


CPU_QUANTIZED = ("auto", "dense", "packed", "mlx")


def load(resolved: ResolvedModel, dtype: str = "auto", path=None, group=None,
         dequantize: bool = False, cpu_quantized: str = "auto", cpu_activations: str = "auto",
         plan_dir=None) -> LoadedModel:
    """Loads `resolved` (or `path`, a variant of it such as a quantized copy) through mlx-lm's
    loader into mixbit's own Qwen3.5 forward (models/forward), then builds its projections from
    one CPU plan. With a distributed `group` of size > 1, the model is sharded tensor-parallel
    across the group's ranks (each holds its slice). `dequantize`: quantized layers become dense
    ones with the dequantized weights (the same function up to rounding).

    `cpu_quantized` says how quantized (and bfloat16) projections run on CPU: "packed" on
    mixbit's kernels over the packed weights, with modes from `cpu_activations` alone
    (`plan.rule_plan`); "auto" as the plan measured on this machine for this variant says
    (`plan.cached_plan`: measured at the first start, kept under `plan_dir`, read back after, so
    two starts compute the same logits), and without the kernels dense when that takes at most a
    quarter of physical memory, else "mlx"; "dense" dequantized to float32 once at load; "mlx"
    through MLX's quantized_matmul with prompts through a transient dequantized copy. Every way
    the served function is the quantized one. `cpu_activations` (kernels.ACTIVATIONS): whether
    the packed kernels take their activations as 16-bit integers per group (and the engine's
    prefill as 8-bit ones) where that measured faster ("auto"), always ("int16"; "int8" with the
    8-bit prefill) or never ("float32")."""
    import mlx.core as mx
    from mlx_lm.utils import load_config, load_model

    from .forward.qwen3_5 import MODEL_TYPES, build, model_classes
    from .registry import read_config

    if cpu_quantized not in CPU_QUANTIZED:
        raise ValueError(f"cpu_quantized {cpu_quantized!r}: allowed {', '.join(CPU_QUANTIZED)}")
    folder = Path(path or resolved.path)
    config = load_config(folder)
    ours = config.get("model_type") in MODEL_TYPES
    classes = {"get_model_classes": model_classes} if ours else {}
    sharded = group is not None and group.size() > 1
    if sharded:
        model, config = load_model(folder, lazy=True, strict=False, **classes)
        model.shard(group)
        mx.eval(model.parameters())
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # ranks in step
    else:
        model, config = load_model(folder, **classes)
    tokenizer, hf_tokenizer = load_tokenizer(folder, config.get("eos_token_id", None))
    target = compute_dtype(dtype)
    plan = summary = None
    cpu = mx.default_device() == mx.cpu and not sharded and not dequantize
    use_kernels = ours and cpu and cpu_quantized in ("auto", "packed") and kernels_available()
    if cpu and cpu_quantized == "packed" and not use_kernels:
        log.warning("CPU: no packed kernels (%s); quantized layers run on MLX's kernels",
                    _kernels_error())
    keep = _stored_for_kernels(model) if use_kernels else {}
    if target is not None:
        # Cast floating weights (scales and biases of quantized layers too); integer packed
        # weights stay as they are. What the kernels read as stored is put back: bfloat16
        # projections, and the bfloat16 scales and biases of quantized ones (half the bytes of
        # float32 copies, in memory and in every decode step; layers the plan serves dense cast
        # them when they dequantize).
        model.set_dtype(target, lambda d: mx.issubdtype(d, mx.floating))
        modules = dict(model.named_modules())
        for p, arrays in keep.items():
            modules[p].update(arrays)
    if not ours:
        if dequantize or (cpu and cpu_quantized in ("auto", "dense")
                          and _dense_bytes(model) <= _physical_memory() // 4):
            _dequantize(model)
    elif dequantize:
        build(model, None, dtype=target)
    elif use_kernels:
        from . import kernels
        from .forward import plan as cpu_plans

        if cpu_quantized == "packed":
            plan = cpu_plans.rule_plan(model, cpu_activations)
        else:
            plan = cpu_plans.cached_plan(model, folder, plan_dir, cpu_quantized, cpu_activations,
                                         dense_budget=_physical_memory() // 4)
        counts = build(model, plan, dtype=target)
        summary = plan.summary(counts)
        log.info("CPU kernels (%s, %d threads, plan %s): %d projections served packed, %d dense "
                 "float32 (%.1f MB) where that measured faster for one decode row",
                 kernels.info().get("isa"), kernels.threads(), plan.source, counts["packed"],
                 counts["dense"], plan.dense_bytes / 1e6)
        for row in summary["shapes"]:
            log.debug("CPU kernels: %s", row)
    elif cpu:
        dense_bytes = _dense_bytes(model)
        keep_packed = dense_bytes and (cpu_quantized == "mlx" or (
            cpu_quantized == "auto" and dense_bytes > _physical_memory() // 4))
        build(model, None, mlx_quantized_prompts=bool(keep_packed), dtype=target)
        if keep_packed:
            log.info("CPU: quantized layers kept packed; prompts multiply through a transient "
                     "dequantized weight (no packed CPU kernels: %s)", _kernels_error())
        elif dense_bytes:
            log.info("CPU: quantized layers dequantized once at load (about %.1f MB dense; "
                     "MLX's CPU quantized kernels are slow past one row)", dense_bytes / 1e6)
    else:
        build(model, None, mlx_quantized_prompts=True)
    mx.eval(model.parameters())
    mx.clear_cache()
    return LoadedModel(model=model, tokenizer=tokenizer, resolved=resolved, config=read_config(folder),
                       cpu_plan=summary, plan=plan, hf_tokenizer=hf_tokenizer)


def load_tokenizer(folder, eos_token_ids=None):
    """The checkpoint's tokenizer exactly as its tokenizer.json says (transformers'
    `PreTrainedTokenizerFast` over the Rust tokenizer), in mlx-lm's `TokenizerWrapper` with the
    streaming detokenizer its decoder needs. Returns (wrapper, transformers tokenizer).

    Not through AutoTokenizer: for a `qwen3_5` checkpoint it builds `Qwen3_5Tokenizer`, which
    hard-codes Qwen3.5's pre-tokenizer rule over the file's and keeps the Python vocabulary and
    merges it was built from (~130 MB at Qwen3.5's 248k tokens, never read again); the file's
    own tokenizer tokenizes identically on Qwen3.5's checkpoints (tests/test_tokenizer.py)."""
    from mlx_lm.tokenizer_utils import (BPEStreamingDetokenizer, NaiveStreamingDetokenizer,
                                        TokenizerWrapper)
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    # Qwen's byte-level BPE decodes with ByteLevel (alone or first in a Sequence)
    decoder = hf.backend_tokenizer.decoder
    byte_level = isinstance(decoder, decoders.ByteLevel) or (
        isinstance(decoder, decoders.Sequence) and "ByteLevel" in str(decoder.__getstate__()))
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    wrapper = TokenizerWrapper(hf, BPEStreamingDetokenizer if byte_level else NaiveStreamingDetokenizer,
                               eos_token_ids=eos_token_ids)
    return wrapper, hf


def kernels_available() -> bool:
    from . import kernels

    return kernels.available()


def _kernels_error() -> str:
    from . import kernels

    return kernels.IMPORT_ERROR or "not used"


def _stored_for_kernels(model) -> dict:
    """What the kernels read as a checkpoint stores it, by module path, before the cast: the
    weight of bfloat16 Linear and Embedding layers, the scales and biases of affine quantized
    ones where they are bfloat16."""
    import mlx.core as mx
    import mlx.nn as nn

    out = {}
    for path, m in model.named_modules():
        if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.bfloat16:
            out[path] = {"weight": m.weight}
        elif type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and "biases" in m \
                and getattr(m, "mode", "affine") == "affine" and m.scales.dtype == mx.bfloat16:
            out[path] = {"scales": m.scales, "biases": m.biases}
    return out


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


def _dequantize(model) -> None:
    """Every quantized layer of `model` (any model type) made dense with its dequantized weight."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    from .forward.layers import dense

    swaps = [(path, dense(m)) for path, m in model.named_modules()
             if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
