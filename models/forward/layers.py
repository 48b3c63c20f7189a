"""The projections of mixbit's forward, built from the CPU plan, and the phase of a call.

A projection is built once, at load, from the loaded MLX layer and its plan entry; what it
computes for an input then depends only on that input's shape and the call's `phase`:

- PREFILL: prompt positions whose logits nobody reads (the engine's prefill): an output head
  stays a lazy MLX op (never evaluated, so never computed), and inside the layers a packed
  projection planned on PANEL8 takes 8-bit activations (only the state a prompt leaves moves);
- DECODE: positions whose logits are read, one or a few per sequence (a decode or verify step);
- SCORE: every position's logits read (teacher forcing: fidelity checks, prompt logprobs), with
  the 16-bit activations a decode step uses, so a check scores the function that produced the
  tokens;
- TRAIN: differentiable MLX ops only (gradients: the sensitivity pass).

A call without a phase is PREFILL for several positions per sequence and DECODE for one: what
mlx-lm's generators, which know no phases, ask of a model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..kernels import PANEL, PANEL8

PREFILL, DECODE, SCORE, TRAIN = "prefill", "decode", "score", "train"
PHASES = (PREFILL, DECODE, SCORE, TRAIN)


def phase_of(x, phase: str | None) -> str:
    """The phase of a call on hidden states x [B, T, D] (see the module's docstring)."""
    if phase is None:
        return PREFILL if x.ndim >= 3 and x.shape[-2] > 1 else DECODE
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: one of {', '.join(PHASES)}")
    return phase


def rows(x) -> int:
    return x.size // x.shape[-1]


class Projection:
    """Marks mixbit's projection modules: they take the phase of the call."""

    def on_kernels(self, x, phase: str) -> bool:
        """Whether self(x, phase) returns a kernel's output (an evaluated float32 array)."""
        return False


def is_packed(module) -> bool:
    """Whether `module` is served on mixbit's kernels (forward only: MLX cannot differentiate them)."""
    return isinstance(module, _Packed)


def verifying(x, phase: str) -> bool:
    """Whether a call is a decode step of several positions per sequence (a verify step): each
    of its positions must compute, bit for bit, what a one-position decode step computes."""
    return phase == DECODE and x.ndim == 3 and x.shape[1] > 1


def per_position(fn, x):
    """fn over x [B, T, ...] one position at a time (what T one-position calls compute)."""
    return mx.concatenate([fn(x[:, t:t + 1]) for t in range(x.shape[1])], axis=1)


def project(module, x, phase: str):
    """module(x) for a projection of the forward: mixbit's take the phase, MLX's (a model that
    was loaded but not built from a plan, e.g. for quantization) do not need it. A decode step
    of several positions per sequence (a verify step) runs position by position on projections
    other than the packed kernels (whose rows never depend on how many share a call): a BLAS
    product rounds differently for one row and for several, and each position must compute
    what a one-position decode step computes."""
    if verifying(x, phase) and not isinstance(module, _Packed):
        return per_position(lambda xt: project(module, xt, phase), x)
    return module(x, phase) if isinstance(module, Projection) else module(x)


class DenseLinear(nn.Linear, Projection):
    """A float32 (or the compute dtype's) weight in MLX's graph."""

    def __call__(self, x, phase: str | None = None):
        return super().__call__(x)


class _Packed(Projection):
    """The matmul of a projection served on mixbit's kernels from its stored bytes (MLX's packed
    affine layout with bfloat16 or float32 scales and biases, or bfloat16), as its ShapePlan says."""

    def _setup(self, source, plan, head: bool):
        """The stored arrays of `source` (MLX's layer as loaded: quantized with scales and biases
        as stored if bfloat16, else as float32; or a bfloat16 weight) and how `plan` (a
        ShapePlan) says they multiply. The kernels read either; MLX's ops here take them as
        float32 (`_groups`), so every path computes with the same values."""
        self.weight = source["weight"]
        self.bits, self.group_size = 16, 0
        if isinstance(source, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            keep = source["scales"].dtype == mx.bfloat16
            self.scales = source["scales"] if keep else source["scales"].astype(mx.float32)
            self.biases = source["biases"] if keep else source["biases"].astype(mx.float32)
            self.bits, self.group_size = source.bits, source.group_size
        self.decode_mode = plan.decode_mode
        self.prompt_mode = plan.prompt_mode  # None: prompts through MLX's dense matmul
        self.prompt_from_rows = plan.prompt_from_rows
        self.head = head  # an output head: lazy over a prompt whose logits nobody reads

    def _lazy(self, x, phase: str) -> bool:
        return self.head and phase == PREFILL

    def _many(self, x, phase: str) -> bool:
        """Whether a call takes the prompt path: many rows, except in a decode step of several
        positions per sequence (a verify step), whose every row must be what a one-position
        decode step computes."""
        return rows(x) >= self.prompt_from_rows and not verifying(x, phase)

    def _mlx(self, x, phase: str) -> bool:
        return phase == TRAIN or (self.prompt_mode is None and self._many(x, phase))

    def on_kernels(self, x, phase: str) -> bool:
        return not (self._lazy(x, phase) or self._mlx(x, phase))

    def kernel_mode(self, x, phase: str) -> int:
        """The planned prompt mode for many rows, the planned decode mode otherwise. PANEL8's
        8-bit activations only inside the layers of a prefill: a decode batch, an output head
        and scoring take PANEL's 16-bit ones, so a token's logits do not depend on how many
        requests share its step."""
        if self.prompt_mode is not None and self._many(x, phase):
            if self.prompt_mode == PANEL8 and (self.head or phase != PREFILL):
                return PANEL
            return self.prompt_mode
        return self.decode_mode

    def _quantized(self) -> bool:
        return self.bits != 16

    def _groups(self, ids=None):
        """The scales and biases (of the rows `ids`) as float32, for MLX's ops."""
        s, b = self["scales"], self["biases"]
        if ids is not None:
            s, b = s[ids], b[ids]
        return s.astype(mx.float32), b.astype(mx.float32)

    def _dense_weight(self):
        if not self._quantized():
            return self["weight"].astype(mx.float32)
        return mx.dequantize(self["weight"], *self._groups(), group_size=self.group_size, bits=self.bits)

    def matmul(self, x, phase: str):
        if self._lazy(x, phase):  # never evaluated: the engine's prefill reads no logits
            if self._quantized():
                return mx.quantized_matmul(x, self["weight"], *self._groups(), transpose=True,
                                           group_size=self.group_size, bits=self.bits)
            return mx.matmul(x.astype(mx.float32), self["weight"].astype(mx.float32).T)
        if self._mlx(x, phase):
            return mx.matmul(x.astype(mx.float32), self._dense_weight().T)
        if self._quantized():
            return kernels.matmul(x, self["weight"], self["scales"], self["biases"], self.bits,
                                  self.group_size, mode=self.kernel_mode(x, phase))
        return kernels.matmul(x, self["weight"], mode=self.kernel_mode(x, phase))


class PackedLinear(nn.Module, _Packed):
    def __init__(self, source, plan, head: bool = False):
        super().__init__()
        self._setup(source, plan, head)
        if "bias" in source:
            self.bias = source["bias"].astype(mx.float32)

    def on_kernels(self, x, phase: str) -> bool:
        return "bias" not in self and _Packed.on_kernels(self, x, phase)

    def __call__(self, x, phase: str | None = None):
        y = self.matmul(x, phase_of(x, phase))
        return y + self["bias"] if "bias" in self else y


class PackedEmbedding(nn.Module, _Packed):
    """A token table served from its stored bytes, and the tied output head over it."""

    def __init__(self, source, plan):
        super().__init__()
        self._setup(source, plan, head=True)

    def __call__(self, ids):
        if not self._quantized():
            return self["weight"][ids].astype(mx.float32)
        return mx.dequantize(self["weight"][ids], *self._groups(ids), group_size=self.group_size,
                             bits=self.bits)

    def as_linear(self, x, phase: str | None = None):
        return self.matmul(x, phase_of(x, phase))


def head_rows(module, ids: mx.array):
    """A projection computing only the output rows `ids` of an output head (a linear layer, or
    a tied table as a linear), each row from the same stored bytes and on the same kernels as
    the whole head computes it: the MTP head's drafts over a reduced vocabulary."""
    if isinstance(module, _Packed):
        out = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(out)
        out.weight = module["weight"][ids]
        out.bits, out.group_size = module.bits, module.group_size
        if module.bits != 16:
            out.scales, out.biases = module["scales"][ids], module["biases"][ids]
        out.decode_mode, out.prompt_mode = module.decode_mode, module.prompt_mode
        out.prompt_from_rows, out.head = module.prompt_from_rows, True
    elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        dims = module["scales"].shape[-1] * module.group_size
        out = MlxQuantizedLinear(dims, ids.size, bias=False, group_size=module.group_size, bits=module.bits)
        out.weight, out.scales = module["weight"][ids], module["scales"][ids]
        if "biases" in module:
            out.biases = module["biases"][ids]
    else:
        w = module["weight"][ids]
        out = DenseLinear(w.shape[1], w.shape[0], bias=False)
        out.weight = w
    mx.eval(out.parameters())
    return out


def _through_dense(layer, x) -> bool:
    return mx.default_device() == mx.cpu and rows(x) >= layer.dense_rows


def _dequantized_matmul(layer, x):
    """x @ W^T through a transient dequantized copy of MLX's quantized `layer` (what its
    quantized_matmul computes)."""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                      bits=layer.bits, mode=layer.mode)
    return mx.matmul(x, w.T)


class MlxQuantizedLinear(nn.QuantizedLinear, Projection):
    """Packed weights on MLX's own quantized kernels (no mixbit kernels here), with calls of
    `dense_rows` rows and more (prompts) through a transient dequantized weight: MLX's CPU
    quantized_matmul grows with every row (docs/cpu-serving.md)."""

    dense_rows = 16

    def __call__(self, x, phase: str | None = None):
        if _through_dense(self, x):
            y = _dequantized_matmul(self, x)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


class MlxQuantizedEmbedding(nn.QuantizedEmbedding, Projection):
    dense_rows = 16

    def as_linear(self, x, phase: str | None = None):
        return _dequantized_matmul(self, x) if _through_dense(self, x) else super().as_linear(x)


def _copy_into(target: nn.Module, source: nn.Module) -> nn.Module:
    target.update(source.parameters())
    for name in ("group_size", "bits", "mode"):
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))
    return target


def mlx_quantized(source):
    """MLX's quantized layer as a projection of the forward (MlxQuantizedLinear/-Embedding)."""
    if isinstance(source, nn.QuantizedLinear):
        w = source["weight"]
        out = MlxQuantizedLinear(w.shape[1] * 32 // source.bits, w.shape[0], bias="bias" in source,
                                 group_size=source.group_size, bits=source.bits,
                                 mode=getattr(source, "mode", "affine"))
    else:
        w = source["weight"]
        out = MlxQuantizedEmbedding(w.shape[0], w.shape[1] * 32 // source.bits, group_size=source.group_size,
                                    bits=source.bits, mode=getattr(source, "mode", "affine"))
    return _copy_into(out, source)


def dense(source, dtype=None):
    """A dense float projection (DenseLinear, or MLX's Embedding for a table: its as_linear
    takes no phase and needs none) with the weight `source` computes (dequantized if packed)."""
    if isinstance(source, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        # scales as loaded (the compute dtype), or as stored where the loader kept them for the
        # kernels: then in `dtype`, so the dense weight is what float32 scales give
        scales, biases = source["scales"], source.get("biases")
        if dtype is not None:
            scales, biases = scales.astype(dtype), None if biases is None else biases.astype(dtype)
        w = mx.dequantize(source["weight"], scales, biases, group_size=source.group_size,
                          bits=source.bits, mode=getattr(source, "mode", "affine"))
    else:
        w = source["weight"]
    if dtype is not None:
        w = w.astype(dtype)
    if isinstance(source, (nn.Linear, nn.QuantizedLinear)):
        out = DenseLinear(w.shape[1], w.shape[0], bias="bias" in source)
        if "bias" in source:
            out.bias = source["bias"].astype(w.dtype)
    else:
        out = nn.Embedding(w.shape[0], w.shape[1])
    out.weight = w
    return out
