"""Packed weights served packed on the CPU: mixbit's kernels on MLX's buffers.

MLX's CPU `quantized_matmul` is slow past one row, so `_qkernel` (qkernel.c, built at install)
reads the weights exactly as MLX stores them - affine 2/3/4/5/6/8-bit in groups of 32/64/128,
and bfloat16 - in place, and a variant is served from its own bytes. `matmul` runs one of the
modes below (which one is the CPU plan's choice, models/forward/plan.py; `measure` times them
for it); each computes what MLX computes for the dequantized weight, to rounding
(tests/test_kernels.py):

- FLOAT: decode rows, float32 FMAs on the weights unpacked in registers;
- INT16: decode rows with their activations as 16-bit integers per group (VNNI);
- BLAS: prompts, the weight dequantized in tiles for cblas_sgemm (the OpenBLAS models/blas.py loads);
- TILES: prompts and decode batches on AMX tiles, exact products;
- PANEL / PANEL8: prompts and decode batches on 16-bit (8-bit) activations against the weights
  unpacked once per call into panels of 64 columns (VNNI).

Beside the projections, Qwen3.5's other costly parts on the CPU: the GatedDeltaNet recurrence over
a prompt or a decode step (`gated_delta`), its short convolution (`depthwise_conv`), SiLU
(`silu`: MLX's Linux build computes exp one value at a time) and the normalisation of a decode
step's logits (`logsumexp`); for the quantizer, the fit of each group's scale and bias a variant
is written with (`fit_affine`, bit for bit quant/formats.py's MLX fit). Each kernel call
evaluates its inputs (a synchronisation), which is why small projections stay dense inside MLX's
graph. docs/cpu-serving.md has how they are used,
docs/cpu-serving-log.md what was measured.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("mixbit.models")

try:
    from . import _qkernel
    IMPORT_ERROR = ""
except ImportError as exc:  # a source checkout without a compiler, or a foreign platform
    _qkernel = None
    IMPORT_ERROR = str(exc)

# Projections under this many weights (Qwen3.5's in_proj_a/in_proj_b: heads x hidden) are not
# worth a synchronisation: they run dense inside MLX's graph (a few hundred KB at most).
SMALL = 1 << 18
# the most of a layer's dense float32 copy `measure` builds to time it
DENSE_PROBE_BYTES = 64 << 20

_started = False


def available() -> bool:
    return _qkernel is not None


def threads() -> int:
    """Kernel threads: MIXBIT_KERNEL_THREADS, else the CPUs this process may run on."""
    env = os.environ.get("MIXBIT_KERNEL_THREADS", "")
    if env.strip():
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def start() -> None:
    global _started
    if not _started and _qkernel is not None:
        _qkernel.set_threads(threads())
        _started = True


def info() -> dict:
    if _qkernel is None:
        return {"isa": None, "error": IMPORT_ERROR}
    start()
    return dict(_qkernel.info())


def supports(bits: int, group_size: int, in_features: int, mode: str = "affine") -> bool:
    if _qkernel is None or mode != "affine":
        return False
    if bits == 16:
        return True
    return bits in (2, 3, 4, 5, 6, 8) and group_size >= 32 and in_features % group_size == 0


FLOAT, INT16, BLAS, TILES, PANEL, PANEL8 = 0, 1, 2, 3, 4, 5  # the kernel's modes (qkernel.c)
# how a packed layer's activations enter its kernels (generation.cpu_activations): "auto" times
# the float and the 16-bit integer kernels (decode rows: FLOAT, INT16; many rows: also PANEL)
# and keeps the fastest per layer shape, "float32" only the exact float paths, "int16" the
# 16-bit integer kernels wherever they run, "int8" 8-bit integer activations for many rows
# (PANEL8, as llama.cpp's CPU kernels quantize theirs) and INT16 for single decode rows
ACTIVATIONS = ("auto", "float32", "int16", "int8")
PROMPT_ROWS = 256  # the rows at which the prompt paths are compared: a prefill chunk
PROMPT_PATHS = {"blas": BLAS, "tiles": TILES, "panel": PANEL, "panel8": PANEL8}
# Dense float32 must also win at this many rows (a decode batch), timed right after a kernel
# call: inside a decode step MLX's dense matmul goes through OpenBLAS, whose threads then compete
# with the kernels' (the 0.8B shape's 512 x 1024 k/v projections: 0.07 ms dense against 0.17 on
# the kernel for one row, but 15-30 ms of a batch-8 step dense against 2 ms on the kernel).
DENSE_CHECK_ROWS = 8


SCRATCH_BYTES = 32 << 20  # kernel output buffers kept for reuse, per thread, in all
SCRATCH_MAX = 8 << 20  # the largest kept: decode outputs (batch 8: the states, the logits)
_scratch = threading.local()


def _output(shape, slot: str = "out"):
    """A float32 buffer for a kernel's output, which mx.array() then copies. Outputs of 1 MB and
    more (a GatedDeltaNet state per layer and decode step, the head's logits at batch > 1) are
    kept per thread and reused: glibc maps each such allocation fresh (models/blas.py sets its
    mmap threshold to 1 MB), and faulting a new 1 MB in cost ~210 us against ~60 us reused.
    A prompt's larger outputs are not kept (they would stay resident)."""
    import numpy as np

    n = 4
    for d in shape:
        n *= d
    if n < 1 << 20 or n > SCRATCH_MAX:
        return np.empty(shape, np.float32)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (slot, tuple(shape))
    buf = bufs.pop(key, None)
    if buf is None:
        buf = np.empty(shape, np.float32)
        while bufs and sum(b.nbytes for b in bufs.values()) + n > SCRATCH_BYTES:
            bufs.pop(next(iter(bufs)))  # least recently used first
    bufs[key] = buf
    return buf


def tiles_available() -> bool:
    """Whether the CPU and the OS let the kernels use AMX tiles (the TILES mode)."""
    return _qkernel is not None and bool(_qkernel.info().get("tiles"))


def int16_support(k: int, bits: int, group: int) -> bool:
    """Whether the INT16 mode runs for this shape: affine weights, a CPU with AVX-512 VNNI,
    groups of 32/64/128 (elsewhere the kernel computes with FLOAT)."""
    return (_qkernel is not None and bool(_qkernel.info().get("vnni")) and bits != 16
            and k % 64 == 0 and group in (32, 64, 128))


def tiles_support(n: int, k: int, bits: int, group: int) -> bool:
    return tiles_available() and n % 32 == 0 and k % 64 == 0 and (bits == 16 or group in (32, 64, 128))


def panel_support(n: int, k: int, bits: int, group: int) -> bool:
    """Whether the PANEL mode runs for this shape: what INT16 needs, and whole panels of 64
    output columns."""
    return int16_support(k, bits, group) and n % 64 == 0


def matmul(x, weight, scales=None, biases=None, bits: int = 16, group_size: int = 0, mode: int = FLOAT):
    """x[..., K] @ W^T for MLX's packed `weight` (affine, `bits` 2-8, float32 or bfloat16 scales/biases)
    or a bfloat16 `weight` (bits=16). Returns float32 [..., N]. `mode`: FLOAT (float32 FMAs on
    the packed weights, for a few rows), BLAS (dequantized in tiles and multiplied by
    cblas_sgemm, for many rows), TILES (AMX: the unpacked weights times x split exactly into
    three bfloat16 parts, for many rows, where tiles_support), INT16 (activations as 16-bit
    integers per group, within 1/65024 of the group's largest value, the products exact in int32
    on VNNI, where int16_support: decode rows, where it measured faster; docs/cpu-serving.md),
    PANEL (INT16's activations, the weights unpacked once per call into panels of 64 output
    columns for vpdpwssd: many rows, where panel_support), PANEL8 (PANEL's panels with the
    activations as 8-bit integers per group, within 1/254 of the group's largest value, for
    vpdpbusd: ~1.5x PANEL, where panel_support)."""
    import mlx.core as mx

    start()
    k = x.shape[-1]
    lead = x.shape[:-1]
    m = 1
    for d in lead:
        m *= d
    n = weight.shape[0]
    out = _output((m, n))
    args = ((weight, weight, weight, out, m, n, k, 16, 0, mode) if bits == 16 else
            (weight, scales, biases, out, m, n, k, bits, group_size, mode))

    # the projections that share an input (q/k/v, z, gate/up) find it evaluated
    _on_inputs(lambda x2: _qkernel.matmul(x2, *args), [x], as_is=x.dtype == mx.float32)
    return mx.array(out.reshape(*lead, n))


def _on_inputs(call, arrays, as_is: bool) -> None:
    """call(*arrays) with the arrays evaluated. Every evaluation of a new MLX node costs ~75 us on
    the CPU (the stream's thread hand-off), so where `as_is` (float32 inputs) they are passed as
    they are; a strided one is refused by the kernel, and then every input is copied contiguous
    float32, as are all inputs otherwise."""
    import mlx.core as mx

    if as_is:
        mx.eval(arrays)
        try:
            return call(*arrays)
        except ValueError as exc:
            if "contiguous" not in str(exc):
                raise
    arrays = [mx.contiguous(t.astype(mx.float32)) for t in arrays]
    mx.eval(arrays)
    return call(*arrays)


def gated_delta(q, k, v, g, beta, state, mask=None):
    """The gated delta rule over T tokens, one after the other with each head's state in cache
    (mlx-lm's `gated_delta_ops` contract for scalar gates; a decode step is T = 1): q, k
    [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk]; mask [B, T]
    (True: a real token; padding leaves the state as it was) or None. Returns y [B, T, Hv, Dv]
    and the new state, in float32."""
    import mlx.core as mx

    start()
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, axis=-2)
        k = mx.repeat(k, Hv // Hk, axis=-2)
    f32 = mx.float32
    g, beta = g.astype(f32), beta.astype(f32)
    if mask is not None:
        keep = mask.astype(mx.bool_)[..., None]
        g, beta = mx.where(keep, g, 1.0), mx.where(keep, beta, 0.0)
    args = [mx.contiguous(a.astype(f32)) for a in (q, k, v, g, beta, state)]
    mx.eval(args)
    y = _output((B, T, Hv, Dv), "y")
    new = _output((B, Hv, Dv, Dk), "state")
    _qkernel.gated_delta_scan(*args, y, new, B, T, Hv, Dk, Dv)
    return mx.array(y), mx.array(new)


def gdn_decode_step(qkv, z, a, b, conv_state, w_t, A_log, dt_bias, state, norm_w, eps: float,
                    key_heads: int, key_dim: int, qk_eps: float = 1e-6):
    """One GatedDeltaNet decode step in one kernel call, from its projections' outputs to
    out_proj's input: qkv [B, C], z [B, Hv * Dv], a and b [B, Hv], conv_state [B, K - 1, C],
    w_t [K, C] (the conv weight transposed), A_log and dt_bias [Hv], state [B, Hv, Dv, Dk],
    norm_w [Dv]. Returns y [B, Hv * Dv] (the gated RMSNorm of the delta rule's output), the new
    conv state and the new recurrent state, float32: what the conv and SiLU, normalize_qk, the
    gates, `gated_delta` and the gated norm compute one after the other."""
    import mlx.core as mx

    start()
    B, C = qkv.shape
    Hv = a.shape[-1]
    Dv = z.shape[-1] // Hv
    K = w_t.shape[0]
    args = [mx.contiguous(t.astype(mx.float32)) for t in
            (qkv, z, a, b, conv_state, w_t, A_log, dt_bias, state, norm_w)]
    mx.eval(args)
    y = _output((B, Hv * Dv), "step_y")
    conv = _output((B, K - 1, C), "step_conv")
    new = _output((B, Hv, Dv, key_dim), "state")
    _qkernel.gdn_decode_step(*args, y, conv, new, B, key_heads, Hv, key_dim, Dv, K, eps, qk_eps)
    return mx.array(y), mx.array(conv), mx.array(new)


def depthwise_conv(x, w_t, then_silu: bool = False):
    """GatedDeltaNet's causal depthwise convolution: x [B, L, C], w_t [K, C] (MLX's Conv1d weight
    [C, K, 1] transposed) -> [B, L - K + 1, C] float32, what `mx.conv1d(x, w, groups=C)` gives;
    with `then_silu`, the SiLU of it (on the kernel, in place)."""
    import mlx.core as mx

    start()
    B, L, C = x.shape
    Kc = w_t.shape[0]
    x = mx.contiguous(x.astype(mx.float32))
    mx.eval(x, w_t)
    y = _output((B, L - Kc + 1, C))
    _qkernel.depthwise_conv(x, w_t, y, B, L - Kc + 1, Kc, C)
    if then_silu:
        _qkernel.silu(y, None, y, y.size)
    return mx.array(y)


ACT_MIN = 1 << 16  # values from which silu runs here whatever its inputs (prompts); below, only evaluated ones


def silu(a, b=None, evaluated: bool = False):
    """silu(a) * b (or silu(a)) in float32 on the kernels: MLX's Linux CPU build computes exp one
    value at a time (docs/cpu-serving.md). Small inputs stay MLX ops (a kernel call costs a
    synchronisation), unless the caller knows them `evaluated` (kernel outputs: a decode step's
    gate and up projections), where the kernel costs no synchronisation and spares the next
    kernel call one."""
    import mlx.core as mx
    import mlx.nn as nn

    if a.size < ACT_MIN and not evaluated:
        y = nn.silu(a.astype(mx.float32))
        return y if b is None else y * b.astype(mx.float32)
    start()
    args = [a] if b is None else [a, b]
    y = _output(a.shape)
    _on_inputs(lambda a2, b2=None: _qkernel.silu(a2, b2, y, a.size), args,
               as_is=evaluated and all(t.dtype == mx.float32 for t in args))
    return mx.array(y)


_blas = None


def blas_available() -> bool:
    """Whether the process has a cblas_sgemm the BLAS mode can call (models/blas.py loads
    OpenBLAS process-wide; MLX's bundled BLAS is not visible)."""
    global _blas
    if _blas is None:
        import mlx.core as mx

        try:
            w = mx.zeros((8, 64), dtype=mx.bfloat16)
            matmul(mx.zeros((1, 64)), w, mode=BLAS)
            _blas = True
        except RuntimeError:
            _blas = False
    return _blas


def shape_key(module) -> tuple:
    w = module["weight"]
    bits = getattr(module, "bits", 16)
    k = w.shape[1] * 32 // bits if bits != 16 else w.shape[1]
    return (w.shape[0], k, bits, getattr(module, "group_size", 0))


def _time(fn, reps: int, rounds: int = 3) -> float:
    import time

    fn()  # warm-up (allocations, first touch)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def _prompt_paths(n: int, k: int, bits: int, group: int, activations: str) -> dict:
    """The prompt paths that run for a layer shape, by name: BLAS where the process has a
    cblas_sgemm, TILES where tiles_support, PANEL where panel_support and `activations` allows
    16-bit activations, PANEL8 where it allows 8-bit ones ("auto": both beside the float paths;
    "int16": PANEL alone where it runs; "int8": PANEL8 and PANEL there, PANEL for decode
    batches and heads, _kernel_mode)."""
    paths = {"blas": BLAS} if blas_available() else {}
    if tiles_support(n, k, bits, group):
        paths["tiles"] = TILES
    if activations != "float32" and panel_support(n, k, bits, group):
        paths = ({"panel": PANEL} if activations == "int16" else {"panel8": PANEL8, "panel": PANEL}
                 if activations == "int8" else {**paths, "panel": PANEL, "panel8": PANEL8})
    return paths


def measure(module, rows=(1, 4, 8, 16, 32, 64), budget_s: float = 0.03, activations: str = "float32") -> dict:
    """Seconds per call of one layer, per number of rows: the packed kernel (FLOAT, "kernel";
    with `activations` "auto" or "int16" also INT16, "int16", where int16_support), the
    prompt paths - dequantize-then-BLAS (BLAS, when the process has a cblas_sgemm), AMX
    tiles (TILES, where the CPU has them) and, with `activations` "auto", PANEL where
    panel_support ("int16": PANEL alone there) - and, for one row, dense float32 as it runs inside a
    lazy graph (several products per evaluation). The prompt paths are also timed at
    PROMPT_ROWS rows, where serve() picks one of them. Each timing takes about `budget_s`."""
    import mlx.core as mx

    n, k, bits, group = shape_key(module)
    # the kernels are timed on the groups as the served layer keeps them (bfloat16 as stored, or
    # float32); dense float32 is what dequantizing with them in float32 gives
    w, s, b = module["weight"], module.get("scales"), module.get("biases")
    if bits != 16 and s.dtype != mx.bfloat16:
        s, b = s.astype(mx.float32), b.astype(mx.float32)
    # Dense float32 is timed on at most DENSE_PROBE_BYTES of its rows and scaled to all of them
    # (one row's product streams the weight: its time grows with the bytes): the full dense copy
    # of every layer shape made loading the 0.8B shape's 439 MB variant peak at 6.9 GB resident
    # (the tied head alone is 1 GB in float32).
    part = n if n * k * 4 <= DENSE_PROBE_BYTES else max(1, DENSE_PROBE_BYTES // (k * 4))
    dense = w[:part].astype(mx.float32) if bits == 16 else mx.dequantize(
        w[:part], s[:part].astype(mx.float32), b[:part].astype(mx.float32), group_size=group, bits=bits)
    mx.eval(dense, s, b)
    prompt = _prompt_paths(n, k, bits, group, activations)
    decode = {"kernel": FLOAT, "int16": INT16}
    if activations == "float32" or not int16_support(k, bits, group):
        del decode["int16"]
    elif activations in ("int16", "int8"):
        del decode["kernel"]
    out = {}
    for m in rows:
        x = mx.random.normal((m, k))
        mx.eval(x)
        t_one = _time(lambda: matmul(x, w, s, b, bits, group), 1, rounds=1)
        reps = max(1, min(64, int(budget_s / max(t_one, 1e-6))))
        chain = min(reps, 8)
        # in a model the kernel's input is a lazy result: its evaluation is part of the cost
        kinds = {name: lambda mode=mode: [matmul(x * 1.0, w, s, b, bits, group, mode=mode) for _ in range(chain)]
                 for name, mode in decode.items()}
        if m > 1:
            for name, mode in prompt.items():
                kinds[name] = lambda mode=mode: [matmul(x * 1.0, w, s, b, bits, group, mode=mode)
                                                 for _ in range(chain)]
        if m == 1:
            kinds["dense"] = lambda: mx.eval([mx.matmul(x, dense.T) for _ in range(chain)])
        elif m == DENSE_CHECK_ROWS:  # dense right after a kernel call, as in a decode step
            first = next(iter(decode))
            kinds["kernel+dense"] = lambda: [(matmul(x * 1.0, w, s, b, bits, group, mode=decode[first]),
                                              mx.eval(mx.matmul(x, dense.T))) for _ in range(chain)]
        out[m] = {name: _time(fn, max(1, reps // chain)) / chain for name, fn in kinds.items()}
        if "kernel+dense" in out[m]:
            out[m]["dense"] = max(0.0, out[m].pop("kernel+dense") - out[m][first])
        if "dense" in out[m]:
            out[m]["dense"] *= n / part
        if m >= DENSE_CHECK_ROWS and min((out[m][p] for p in prompt), default=float("inf")) < \
                min(out[m][d] for d in decode):
            break  # past the crossover (serve() takes the first row count where a prompt path won)
    if len(prompt) > 1 and max(out) > 1:  # which prompt path, at a prefill chunk's rows
        x = mx.random.normal((PROMPT_ROWS, k))
        mx.eval(x)
        out["prompt"] = {name: _time(lambda mode=mode: matmul(x * 1.0, w, s, b, bits, group, mode=mode), 1)
                         for name, mode in prompt.items()}
    dense = None  # the closures above are done with it
    mx.clear_cache()  # the next shape's copies must not stack on this one's
    return out


def decode_kind(t: dict) -> str:
    """The faster decode kernel of a layer shape's timings (`measure`) at one row: "kernel"
    (FLOAT) or "int16" (INT16)."""
    return min((k for k in ("kernel", "int16") if k in t[1]), key=lambda k: t[1][k])


LSE_MIN = 1 << 15  # values a row from which logsumexp runs here (a real vocabulary)


def logsumexp(a, axis=None, keepdims: bool = False, **kwargs):
    """mx.logsumexp, computed on the kernels for the last axis of long float rows on the CPU:
    mlx-lm normalises every decode step's logits with it, and MLX's Linux CPU build takes
    9 ms a row of 248,320 values (60-70 ms for a batch of 8) where the kernel takes ~0.3 ms.
    Anything else goes to MLX as it is."""
    import mlx.core as mx

    n = a.shape[-1] if a.ndim else 0
    if (_qkernel is None or kwargs or a.ndim == 0 or a.size == 0 or n < LSE_MIN
            or axis not in (-1, a.ndim - 1, [-1], (-1,), [a.ndim - 1], (a.ndim - 1,))
            or not mx.issubdtype(a.dtype, mx.floating) or mx.default_device() != mx.cpu):
        return mx.logsumexp(a, axis=axis, keepdims=keepdims, **kwargs)
    start()
    x = mx.contiguous(a.astype(mx.float32))
    mx.eval(x)
    rows = x.size // n
    y = _output((rows,), "lse")
    _qkernel.logsumexp(x, y, rows, n)
    return mx.array(y).reshape(*a.shape[:-1], *((1,) if keepdims else ())).astype(a.dtype)


def fit_available() -> bool:
    """Whether the affine fit runs here (`fit_affine`): a CPU stream and the built kernels."""
    import mlx.core as mx

    return _qkernel is not None and hasattr(_qkernel, "fit_affine") and mx.default_device() == mx.cpu


def fit_affine(x, bits: int, group_size: int, reach: int):
    """quant/formats.py's fit of each group's scale and bias, on the kernels (mx.quantize's own
    choice computed here too): x float32 [rows, cols]. Returns numpy arrays: the codes packed as
    MLX packs them (uint32 [rows, cols * bits / 32]), the fitted scales and biases (float32
    holding bfloat16 values). The same bits as the MLX fit (tests/test_quant_formats.py)."""
    import mlx.core as mx
    import numpy as np

    start()
    rows, cols = x.shape
    groups = rows * (cols // group_size)
    x = mx.contiguous(x.astype(mx.float32))
    mx.eval(x)
    packed = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // group_size), np.float32)
    biases = np.empty((rows, cols // group_size), np.float32)
    _qkernel.fit_affine(x, packed, scales, biases, groups, group_size, bits, reach)
    return packed, scales, biases
