"""Quantization formats, their sizes, and the tensors of a model they apply to."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mixbit.models import kernels

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


# The affine fit: MLX stores w ~ scale * q + bias per group, q in 0..2^bits-1, and dequantizes
# whatever scale and bias it is given. mx.quantize takes them from the group's min and max (round to
# nearest); mixbit fits them instead, as llama.cpp's K-quants do (make_qkx2_quants): a few
# candidate ranges around min..max, each rounded, then the least-squares scale and bias of those
# codes; the candidate with the least squared error wins, per group (mx.quantize's own choice is
# one of them). Same format, same bytes, read by stock MLX. What it buys (docs/llama-quality.md)
# and costs (docs/sizes.md, tests/bench/fit_bench.py) is measured there. On a CPU the fit runs on
# mixbit's kernels (models/kernels: the same arithmetic in the same order, the same bits); this
# MLX version is the reference and the fallback where they are not built.
# Ranges tried besides mx.quantize's, (2^bits - 1 + 0.1 k) / (max - min) for |k| <= this, by bits:
# the fit is worth most at few bits and costs per range.
FIT_RANGES = {2: 2, 3: 2, 4: 2, 5: 1, 6: 0, 8: 0}
FIT_ELEMENTS = 1 << 22  # weights fitted at a time: the fit's float32 temporaries stay ~100 MB


def fit_affine(w: mx.array, fmt: Format) -> tuple[mx.array, mx.array, mx.array]:
    """(codes uint8, scales, biases) of a 2-D weight in `fmt`, fitted per group; scales and
    biases bf16, as MLX stores them for a bf16 checkpoint (callers go a row chunk at a time)."""
    rows, cols = w.shape
    gs, nmax = fmt.group_size, float(2 ** fmt.bits - 1)
    x = w.astype(mx.float32).reshape(rows, cols // gs, gs)
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    span = hi - lo
    flat = span <= 0  # a constant group: scale 0 would divide by zero; any scale codes it exactly
    span = mx.where(flat, 1.0, span)
    sx = x.sum(axis=-1, keepdims=True)

    def solve(q):  # least-squares scale and bias of the codes q
        sq, sqq, sqx = q.sum(axis=-1, keepdims=True), (q * q).sum(axis=-1, keepdims=True), (q * x).sum(axis=-1, keepdims=True)
        det = gs * sqq - sq * sq
        ok = det > 0
        det = mx.where(ok, det, 1.0)
        return mx.where(ok, (gs * sqx - sq * sx) / det, span / nmax), mx.where(ok, (sqq * sx - sq * sqx) / det, lo)

    def codes(scale, bias):  # the nearest codes for a scale and bias
        return mx.clip(mx.round((x - bias) / mx.where(scale == 0, 1.0, scale)), 0, nmax)

    def score(scale, bias):  # bf16 as stored; codes for those; squared error, per group
        scale, bias = scale.astype(mx.bfloat16).astype(mx.float32), bias.astype(mx.bfloat16).astype(mx.float32)
        d = scale * codes(scale, bias) + bias - x
        return (d * d).sum(axis=-1, keepdims=True), scale, bias

    # mx.quantize's own scale and bias first (round to nearest; it keeps one edge of the group
    # exact, so its scale may be negative): the fit is never worse than MLX's quantizer. Only the
    # per-group (error, scale, bias) of the best candidate is kept; its codes are rounded once at
    # the end (the same rounding as its score's). Whole-weight passes are what the fit costs on a
    # CPU: element-wise products, not powers (`** 2` is ~25x a product in MLX on CPU), and no
    # full-size selects (a select is ~10x a product): ~2.5x less time, the same bits.
    _, s0, b0 = mx.quantize(w, group_size=gs, bits=fmt.bits)
    best = score(s0.astype(mx.float32)[..., None], b0.astype(mx.float32)[..., None])
    best = min_of(best, score(*solve(codes(best[1], best[2]))))
    reach = FIT_RANGES.get(fmt.bits, 0)
    for k in range(-reach, reach + 1) if reach else ():
        q = mx.clip(mx.round((x - lo) * ((nmax + 0.1 * k) / span)), 0, nmax)
        best = min_of(best, score(*solve(q)))
    _, scale, bias = best
    q = codes(scale, bias) * (1.0 - flat.astype(mx.float32))  # a constant group: codes 0
    scale = mx.where(flat, 0.0, scale)
    bias = mx.where(flat, lo, bias)
    return (q.reshape(rows, cols).astype(mx.uint8), scale.squeeze(-1).astype(mx.bfloat16),
            bias.squeeze(-1).astype(mx.bfloat16))


def min_of(a, b):
    """Per group, the (error, scale, bias) with the smaller error."""
    better = b[0] < a[0]
    return tuple(mx.where(better, y, x) for x, y in zip(a, b))


def pack(codes: mx.array, bits: int) -> mx.array:
    """Codes (rows, cols) as MLX packs them: each row a little-endian bit stream of `bits`-wide
    codes in uint32 words (for every width MLX has; tests/test_quant_formats.py). 32 codes fill
    `bits` words exactly; each code is shifted into its word (and the next, where it straddles
    one), a slice of 1/32 of the codes at a time."""
    rows, cols = codes.shape
    c = codes.astype(mx.uint32).reshape(rows, cols // 32, 32)
    words = [None] * bits
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        part = c[..., j] << shift if shift else c[..., j]
        words[word] = part if words[word] is None else words[word] | part
        if shift + bits > 32:
            spill = c[..., j] >> (32 - shift)
            words[word + 1] = spill if words[word + 1] is None else words[word + 1] | spill
    return mx.stack(words, axis=-1).reshape(rows, cols * bits // 32)


def _row_chunks(w: mx.array):
    """A weight as 2-D row chunks of about FIT_ELEMENTS (stacked experts' rows run on)."""
    flat = w.reshape(-1, w.shape[-1])
    step = max(1, FIT_ELEMENTS // flat.shape[1])
    for s in range(0, flat.shape[0], step):
        yield flat[s:s + step]


_CPU_STREAMS: list = []


def cpu_streams(n: int = 2) -> list:
    """Up to `n` (at most two) streams to run independent element-wise work side by side (the MLX
    fit's chunks, the formats of the activation-weighted errors): MLX runs a stream's element-wise
    work on one CPU thread, so two streams use two cores. Off the CPU, the device's one stream."""
    if mx.default_device() != mx.cpu:
        return [mx.default_stream(mx.default_device())]
    if not _CPU_STREAMS:
        _CPU_STREAMS.extend(mx.new_stream(mx.cpu) for _ in range(2))
    return _CPU_STREAMS[:max(1, n)]


def quantize(w: mx.array, fmt: Format, streams: int = 2, kernel: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """(packed weight, scales, biases) in MLX's format, fitted (fit_affine); 2-D or stacked 3-D,
    a row chunk at a time (groups run along the last axis). On a CPU the fit runs on mixbit's
    kernels where they are built (`kernel`; the same bits, tests/bench/fit_bench.py), else in MLX with
    `streams` chunks at once (the same bits at any count)."""
    if kernel and kernels.fit_available():
        return _quantize_on_kernels(w, fmt)
    parts, pending = [], []
    streams = cpu_streams(streams)
    for chunk in _row_chunks(w):
        with mx.stream(streams[len(pending)]):
            codes, scales, biases = fit_affine(chunk, fmt)
            pending.append((pack(codes, fmt.bits), scales, biases))
        if len(pending) == len(streams):
            mx.eval(pending)
            parts += pending
            pending = []
    mx.eval(pending)
    parts += pending
    return _joined(parts, w.shape)


def _quantize_on_kernels(w: mx.array, fmt: Format) -> tuple[mx.array, mx.array, mx.array]:
    parts = []
    reach = FIT_RANGES.get(fmt.bits, 0)
    for chunk in _row_chunks(w):
        packed, scales, biases = kernels.fit_affine(chunk, fmt.bits, fmt.group_size, reach)
        parts.append((mx.array(packed), mx.array(scales).astype(mx.bfloat16),
                      mx.array(biases).astype(mx.bfloat16)))
    return _joined(parts, w.shape)


def _joined(parts: list, shape) -> tuple[mx.array, mx.array, mx.array]:
    """Row chunks' (packed, scales, biases) as one weight's, in its leading shape."""
    return tuple(mx.concatenate([p[i] for p in parts]).reshape(*shape[:-1], -1) for i in range(3))


def fake_quantize(w: mx.array, fmt: Format) -> mx.array:
    """The weight rounded to nearest in `fmt` (mx.quantize's min..max), then dequantized: the
    sensitivity passes' estimate of a format's error, 50-100x cheaper than the fit that writes
    the variant (`quantize`), whose error is lower by about the same share at every tensor
    (so the allocation's ranking holds and its predicted KLD is an upper bound)."""
    if fmt.bits == 16:
        return w.astype(mx.bfloat16).astype(w.dtype)
    if w.ndim == 3 and w.shape[0] > 8 and w.size > (1 << 26):  # 256 stacked experts: by chunks
        step = max(1, (1 << 26) // (w.shape[1] * w.shape[2]))
        return mx.concatenate([fake_quantize(w[s:s + step], fmt) for s in range(0, w.shape[0], step)])
    q, scales, biases = mx.quantize(w, group_size=fmt.group_size, bits=fmt.bits)
    return mx.dequantize(q, scales, biases, group_size=fmt.group_size, bits=fmt.bits).astype(w.dtype)


# MLX's CPU dequantize holds 2-7 times its output in temporaries (a 17408 x 5120 weight at 6
# bits: 2.5 GB for a 0.36 GB result): a large weight is dequantized this many float32 bytes of
# rows at a time, each chunk evaluated before the next
DEQUANTIZE_CHUNK_BYTES = 32 << 20


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array, fmt: Format) -> mx.array:
    """float32 weights of packed ones, as mixbit's CPU serving computes them (float32 scales);
    a large 2-D weight a chunk of rows at a time (the same numbers: each weight on its own)."""
    rows = packed.shape[0]
    step = max(1, DEQUANTIZE_CHUNK_BYTES // (4 * scales.shape[-1] * fmt.group_size))
    if packed.ndim != 2 or rows <= step:
        return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                             group_size=fmt.group_size, bits=fmt.bits)
    parts = []
    for r in range(0, rows, step):
        parts.append(dequantize(packed[r:r + step], scales[r:r + step], biases[r:r + step], fmt))
        mx.eval(parts[-1])
    return mx.concatenate(parts)


def tensor_class(path: str) -> str:
    """'language_model.model.layers.3.linear_attn.out_proj' -> 'linear_attn.out_proj'."""
    parts = path.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[i + 2:])
    return parts[-1]
