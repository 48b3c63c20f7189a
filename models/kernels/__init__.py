"""Packed weights served packed on the CPU: our own kernels on MLX's buffers.

MLX's CPU `quantized_matmul` is no faster than dense float32 for one row and its cost grows with
every row (issue 16's table: 636 ms for one decode step of the 0.8B shape's projections), so until
now a quantized variant was dequantized to float32 at load and served from ~7x its own bytes.
`_qkernel` (qkernel.c, built at install) reads the weights exactly as MLX stores them - affine
2/3/4/5/6/8-bit in groups of 32/64/128, and bfloat16 - in place, so a variant is served from its
own bytes:

- decode rows (a few per call): float32 FMAs on the packed weights, unpacked in registers;
- prompt rows (from a crossover measured per layer shape, ~16-64 rows): the weight dequantized in
  tiles of at most 64 MB and multiplied by cblas_sgemm (the OpenBLAS models/blas.py loads).

Both compute what MLX computes for the dequantized weight, in float32 (to rounding; tests/
test_kernels.py checks every width and group size). On CPUs with AVX-512 VNNI, decode rows may
instead take their activations as 16-bit integers per group (INT16: within 1/65024 of the
group's largest value, the products exact in int32; ~2x the float kernel for one row, KLD
against it ~1e-7 on the trained embedded model); `generation.cpu_activations` and the timing
at load decide (docs/cpu-serving.md).

Beside the projections, for Qwen3.5's other costly parts on CPU: the GatedDeltaNet recurrence
over a prompt or one decode step (`gated_delta`), its short convolution (`depthwise_conv`) and the
SiLUs of a prompt (`silu`: MLX's Linux build computes exp one value at a time), and the
normalisation of every decode step's logits (`logsumexp`, inside `engine_step()`).

`serve(model)` times each layer shape here and switches the model's QuantizedLinear,
QuantizedEmbedding (a tied output head) and bfloat16 Linear layers; where any of them runs packed
(real sizes), also the depthwise Conv1d, the SwiGLU MLP and the gated RMSNorm. Each kernel call evaluates its
input (a synchronisation, ~20-60 us), which is why small projections stay dense inside MLX's graph
and why "auto" keeps a layer dense where that measured faster (the embedded model). The output
head of a prompt stays lazy: mlx-lm's prompt processing never evaluates those logits.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import types

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
    """x[..., K] @ W^T for MLX's packed `weight` (affine, `bits` 2-8, float32 scales/biases)
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


def _candidates(model, small: int = 0):
    """(path, module, kind) for every projection the kernels can run."""
    import mlx.core as mx
    import mlx.nn as nn

    for path, module in model.named_modules():
        kind = type(module)
        if kind in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            k = module["weight"].shape[1] * 32 // module.bits
            if module["weight"].shape[0] * k < small:
                continue
            if supports(module.bits, module.group_size, k, getattr(module, "mode", "affine")) \
                    and module.get("biases") is not None:
                yield path, module, "quantized"
        elif kind in (nn.Linear, nn.Embedding) and module.weight.dtype == mx.bfloat16 \
                and module.weight.shape[-1] % 64 == 0 and module.weight.size >= max(small, 1):
            yield path, module, "bfloat16"


def _shape_key(module) -> tuple:
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

    n, k, bits, group = _shape_key(module)
    w, s, b = module["weight"], module.get("scales"), module.get("biases")
    if bits != 16:
        s, b = s.astype(mx.float32), b.astype(mx.float32)
    # Dense float32 is timed on at most DENSE_PROBE_BYTES of its rows and scaled to all of them
    # (one row's product streams the weight: its time grows with the bytes): the full dense copy
    # of every layer shape made loading the 0.8B shape's 439 MB variant peak at 6.9 GB resident
    # (the tied head alone is 1 GB in float32).
    part = n if n * k * 4 <= DENSE_PROBE_BYTES else max(1, DENSE_PROBE_BYTES // (k * 4))
    dense = w[:part].astype(mx.float32) if bits == 16 else mx.dequantize(
        w[:part], s[:part], b[:part], group_size=group, bits=bits)
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


def serve(model, mode: str = "auto", dense_budget: int = 0, restore: dict | None = None,
          small: int = SMALL, activations: str = "auto") -> dict:
    """Chooses, per layer shape, how each quantized or bfloat16 projection runs on the CPU, by
    timing it here (`measure`): "auto" keeps a layer packed on the kernel unless dense float32
    measured faster for one decode row and for a batch of DENSE_CHECK_ROWS (after a kernel
    call, as in a decode step) and its dense weight fits `dense_budget` (bytes, over
    all such layers); "packed" keeps every supported layer packed. A packed layer multiplies
    prompts (rows >= its measured crossover) on the AMX tiles or through tiles of dequantized
    weight and BLAS or on 16-bit activations against column panels (PANEL, unless `activations`
    is "float32"), whichever measured faster for a prefill chunk of that layer.
    `restore`: bfloat16 weights by module path to put back (the loader cast everything to
    float32; the kernel reads bfloat16 itself). `activations` (ACTIVATIONS): whether decode rows
    may run on the INT16 kernel and prompts on PANEL, where they measured faster ("auto"), always
    where they run ("int16"), or never ("float32"). Returns a summary for the log and /v1/models."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: allowed {', '.join(ACTIVATIONS)}")
    import mlx.core as mx
    import mlx.nn as nn

    start()
    restore = restore or {}
    modules = dict(model.named_modules())
    for path, w in restore.items():
        if path in modules:
            modules[path].weight = w
    cands = list(_candidates(model, small))
    for _, module, _ in cands:
        mx.eval(module.parameters())
    timings, choice = {}, {}
    for _, module, _ in cands:
        key = _shape_key(module)
        if key not in timings:
            timings[key] = measure(module, activations=activations)
    # dense where it measured faster for one row, largest gain per byte first, within budget
    budget = dense_budget if mode == "auto" else 0
    # dense where it measured faster for one row by a margin and for a decode batch right after
    # a kernel call (on two cores, mixing OpenBLAS's threads with the kernels' in one decode
    # step costs more than either; DENSE_CHECK_ROWS)
    def prefer_dense(key, t):
        several = dict(t.get(DENSE_CHECK_ROWS, {}))  # against the faster packed path at those rows
        dense_several = several.pop("dense", 0.0)
        return t[1]["dense"] * 1.25 < t[1][decode_kind(t)] and dense_several < min(several.values(), default=1.0)

    gains = sorted(((t[1][decode_kind(t)] - t[1]["dense"], key) for key, t in timings.items()
                    if prefer_dense(key, t)), reverse=True)
    dense_keys, spent = set(), 0
    per_key_bytes = {}
    for _, module, _ in cands:
        key = _shape_key(module)
        per_key_bytes[key] = per_key_bytes.get(key, 0) + key[0] * key[1] * 4
    for _, key in gains:
        if spent + per_key_bytes[key] <= budget:
            dense_keys.add(key)
            spent += per_key_bytes[key]
    summary = {"packed": 0, "dense": 0, "dense_bytes": spent, "shapes": []}
    swaps = []
    for path, module in model.named_modules():  # small quantized projections: dense, in-graph
        if type(module) is nn.QuantizedLinear and all(path != p for p, _, _ in cands):
            swaps.append((path, _dense_module(module)))
    for path, module, kind in cands:
        key = _shape_key(module)
        t = timings[key]
        if key in dense_keys:
            swaps.append((path, _dense_module(module)))
            summary["dense"] += 1
            continue
        # the kernel's cost grows with every row, a prompt path's far more slowly: the faster
        # prompt path at a prefill chunk's rows, from the smallest measured row count where it
        # won (or past the largest measured)
        rows_t = {m: v for m, v in t.items() if m != "prompt"}
        paths = t.get("prompt") or {p: 0.0 for p in rows_t[max(rows_t)] if p in PROMPT_PATHS}
        best = min(paths, key=paths.get) if paths else None
        if activations == "int8" and "panel8" in paths:  # wherever it runs (PANEL was timed for batches)
            best = "panel8"
        dec = decode_kind(t)
        # decode batches under PANEL8 run on PANEL (_kernel_mode): its rows decide the crossover
        batch = "panel" if best == "panel8" else best
        wins = [m for m in sorted(rows_t) if m > 1 and rows_t[m].get(batch, float("inf")) < rows_t[m][dec]]
        cross = wins[0] if wins else 2 * max(rows_t)
        module._prefill_rows = cross
        module._prompt_mode = PROMPT_PATHS.get(best)
        module._decode_mode = INT16 if dec == "int16" else FLOAT
        module._head = path.endswith("lm_head") or type(module) in (nn.QuantizedEmbedding, nn.Embedding)
        if kind == "quantized":
            module.scales = module.scales.astype(mx.float32)
            module.biases = module.biases.astype(mx.float32)
            module.__class__ = _PackedLinear if type(module) is nn.QuantizedLinear else _PackedEmbedding
        else:
            module.__class__ = _Bf16Linear if type(module) is nn.Linear else _Bf16Embedding
        choice[key] = (cross, best)
        summary["packed"] += 1
    for key, t in sorted(timings.items()):
        dec = decode_kind(t)
        summary["shapes"].append({
            "out": key[0], "in": key[1], "bits": key[2], "group": key[3],
            "runs": "dense" if key in dense_keys else "packed",
            "kernel_ms_1row": round(t[1][dec] * 1e3, 3), "dense_ms_1row": round(t[1]["dense"] * 1e3, 3),
            "decode": "int16" if dec == "int16" else "float32",
            "prefill_from_rows": choice.get(key, (None,))[0], "prefill": choice.get(key, (None, None))[1]})
    if summary["packed"]:  # real size: GatedDeltaNet's short convolutions and the SiLUs too
        for _, module in model.named_modules():
            conv = module.get("conv1d") if isinstance(module, nn.Module) else None
            if isinstance(conv, nn.Module) and _depthwise(conv) and _silu_follows_conv(module):
                conv._fuse_silu = True
                _install_silu_done(module)
        for _, module in model.named_modules():
            if _depthwise(module):
                # evaluated here: MLX streams are per thread, and the engine's thread could not
                # evaluate a lazy array built on the loader's
                module._w_t = mx.contiguous(module.weight[..., 0].T.astype(mx.float32))
                mx.eval(module._w_t)
                module.__class__ = _DepthwiseConv1d
            elif type(module).__name__ in _ACTIVATED:
                module.__class__ = _ACTIVATED[type(module).__name__]
    if swaps:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(swaps))
    mx.clear_cache()  # the measurements' dense copies go back to the system
    # what stays dense in float32 beyond the candidates (norms, small layers) is cast already
    return summary


def _depthwise(module) -> bool:
    import mlx.nn as nn

    if type(module) is not nn.Conv1d or "bias" in module:
        return False
    c_out, _, c_in = module.weight.shape
    return (c_in == 1 and module.groups == c_out and module.padding == 0 and module.stride == 1
            and module.dilation == 1)


def _dense_module(module):
    import mlx.core as mx
    import mlx.nn as nn

    bits = getattr(module, "bits", 16)
    w = module["weight"].astype(mx.float32) if bits == 16 else _dequantized(module)
    if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
        if "bias" in module:
            dense.bias = module["bias"].astype(mx.float32)
    else:
        dense = nn.Embedding(w.shape[0], w.shape[1])
    dense.weight = w
    return dense


def _rows(x) -> int:
    return x.size // x.shape[-1]


LAZY, MLX, KERNEL = "lazy", "mlx", "kernel"


def _route(layer, x) -> str:
    """Where a packed or bfloat16 projection multiplies `x`: LAZY (an output head over a prompt
    nobody reads: an MLX op never evaluated), MLX (a prompt whose shape measured faster through
    MLX's dense matmul), or KERNEL (mixbit's kernels, FLOAT for decode rows and the measured
    prompt mode for a prompt: an evaluated float32 output)."""
    if layer._head and _lazy_head(x):
        return LAZY
    if _rows(x) >= layer._prefill_rows and layer._prompt_mode is None:
        return MLX
    return KERNEL


def _kernel_mode(layer, x) -> int:
    """The kernels' mode for `x`: the measured prompt mode (AMX tiles, BLAS, PANEL or PANEL8) for
    many rows where there is one, the measured decode mode (FLOAT or INT16) otherwise (decode
    rows; a tied head over a prompt without one). PANEL8's 8-bit activations are for the engine's
    prefill only (inside `prompt_logits_unused()`), inside the layers, whose outputs a request
    reads only through the state they leave (KLD 1.5e-4 against float32 on the embedded model,
    `tests/bench/activations_kld.py`): a decode batch (one position per sequence), an output head
    and teacher-forced scoring (fidelity checks, prompt logprobs) take PANEL's 16-bit ones, so a
    token's logits do not depend on how many requests share its step, and a fidelity check
    scores the function that produced the tokens."""
    if _rows(x) >= layer._prefill_rows and layer._prompt_mode is not None:
        # the engine's prefill is where a head's output is left lazy (_lazy_head)
        if layer._prompt_mode == PANEL8 and (layer._head or not _lazy_head(x)):
            return PANEL
        return layer._prompt_mode
    return layer._decode_mode


def _on_kernels(module, x) -> bool:
    """Whether `module(x)` returns a kernel's output (an evaluated float32 array), not an MLX op."""
    return (isinstance(module, tuple(k for k in (_PackedLinear, _Bf16Linear) if k))
            and "bias" not in module and _route(module, x) == KERNEL)


def _positions(x) -> int:
    return x.shape[-2] if x.ndim >= 3 else 1


_local = threading.local()


@contextlib.contextmanager
def prompt_logits_unused():
    """The kernels run eagerly, and mlx-lm's prompt processing calls the model for its cache
    alone and never evaluates the logits: inside this context (the engine's steps), the output
    head over a prompt (several positions per sequence) stays a lazy MLX operation, never
    computed. Everywhere else (fidelity scoring, prompt logprobs) it runs on the kernels."""
    before = getattr(_local, "lazy_head", False)
    _local.lazy_head = True
    try:
        yield
    finally:
        _local.lazy_head = before


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


class _StepMx(types.ModuleType):
    """mlx.core as mlx_lm.generate sees it: the same module, except that logsumexp runs on the
    kernels inside `engine_step()` (on the thread that runs it); elsewhere it is MLX's."""

    def __init__(self, mx):
        super().__init__(mx.__name__)
        self._mx = mx

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def logsumexp(self, a, *args, **kwargs):
        if getattr(_local, "engine_step", False):
            return logsumexp(a, *args, **kwargs)
        return self._mx.logsumexp(a, *args, **kwargs)


@contextlib.contextmanager
def engine_step():
    """One step of the serving engine (mlx-lm's BatchGenerator.next): the head over a prompt
    stays lazy (`prompt_logits_unused`) and mlx-lm's normalisation of the logits, which every
    decode step computes for every row whatever the sampler, runs on the kernels."""
    generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is a function)
    if _qkernel is not None and not isinstance(generate.mx, _StepMx):
        generate.mx = _StepMx(generate.mx)
    before = getattr(_local, "engine_step", False)
    _local.engine_step = True
    try:
        with prompt_logits_unused():
            yield
    finally:
        _local.engine_step = before


def _lazy_head(x) -> bool:
    return _positions(x) > 1 and getattr(_local, "lazy_head", False)


def _dequantized(layer):
    import mlx.core as mx

    return mx.dequantize(layer["weight"], layer["scales"].astype(mx.float32),
                         layer["biases"].astype(mx.float32), group_size=layer.group_size,
                         bits=layer.bits)


def _classes():
    import mlx.core as mx
    import mlx.nn as nn

    # set by serve(): from how many rows a call is a prompt, and its path (BLAS, TILES, PANEL,
    # PANEL8 or None: MLX's dense matmul)
    class PackedLinear(nn.QuantizedLinear):
        _head = False
        _prompt_mode = None
        _decode_mode = FLOAT

        def __call__(self, x):
            route = _route(self, x)
            if route == LAZY:  # untied output head over a prompt
                y = mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"], transpose=True,
                                        group_size=self.group_size, bits=self.bits)
            elif route == MLX:
                y = mx.matmul(x, _dequantized(self).T)
            else:  # decode rows, or a prompt on the AMX tiles or BLAS, as measured
                y = matmul(x, self["weight"], self["scales"], self["biases"], self.bits, self.group_size,
                           mode=_kernel_mode(self, x))
            return y + self["bias"] if "bias" in self else y

    class PackedEmbedding(nn.QuantizedEmbedding):
        _head = True  # used as the tied output head
        _prompt_mode = None
        _decode_mode = FLOAT

        def as_linear(self, x):  # the tied output head
            if _lazy_head(x):  # a prompt whose logits nobody reads: lazy, never computed
                return mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                           transpose=True, group_size=self.group_size, bits=self.bits)
            return matmul(x, self["weight"], self["scales"], self["biases"], self.bits, self.group_size,
                          mode=_kernel_mode(self, x))

    class Bf16Linear(nn.Linear):
        _head = False
        _prompt_mode = None
        _decode_mode = FLOAT

        def __call__(self, x):
            if _route(self, x) == KERNEL:
                y = matmul(x, self["weight"], mode=_kernel_mode(self, x))
            else:  # LAZY (unused prompt logits, never computed) or MLX
                y = mx.matmul(x.astype(mx.float32), self["weight"].astype(mx.float32).T)
            return y + self["bias"].astype(mx.float32) if "bias" in self else y

    class Bf16Embedding(nn.Embedding):
        _head = True  # used as the tied output head
        _prompt_mode = None
        _decode_mode = FLOAT

        def __call__(self, x):
            return self["weight"][x].astype(mx.float32)

        def as_linear(self, x):
            if _lazy_head(x):
                return mx.matmul(x.astype(mx.float32), self["weight"].astype(mx.float32).T)
            return matmul(x, self["weight"], mode=_kernel_mode(self, x))

    class DepthwiseConv1d(nn.Conv1d):
        _fuse_silu = False  # serve(): where the layer applies nn.silu to this output next

        def __call__(self, x):
            if not self._fuse_silu:
                return depthwise_conv(x, self._w_t)
            # the SiLU that follows in GatedDeltaNet runs here on the conv's output (a prompt's
            # and a decode step's: the call has synchronised already), and the nn.silu the layer
            # applies next gives this output back as it is (_SiluDone)
            y = depthwise_conv(x, self._w_t, then_silu=True)
            _silu_done.y = y
            return y

    return PackedLinear, PackedEmbedding, Bf16Linear, Bf16Embedding, DepthwiseConv1d


def _activated_classes() -> dict:
    """Qwen3.5's SwiGLU MLP and gated RMSNorm (mlx-lm's classes) with the SiLU on the kernels."""
    import mlx.core as mx
    from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextRMSNormGated

    class MLP(Qwen3NextMLP):
        def __call__(self, x):
            # where both projections ran on the kernels (their outputs are evaluated), the SiLU
            # runs there too for any number of rows: no synchronisation, and down_proj's input
            # then needs none either (a decode step: one fewer MLX hand-off per layer)
            return self.down_proj(silu(self.gate_proj(x), self.up_proj(x),
                                       evaluated=_on_kernels(self.gate_proj, x) and _on_kernels(self.up_proj, x)))

    class RMSNormGated(Qwen3NextRMSNormGated):
        def __call__(self, hidden_states, gate=None):
            x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
            if gate is None:
                return x.astype(hidden_states.dtype)
            return silu(gate, x).astype(hidden_states.dtype)

    return {"Qwen3NextMLP": MLP, "Qwen3NextRMSNormGated": RMSNormGated}


_silu_done = threading.local()  # the last convolution output that has had its SiLU, per thread


class _SiluDone(types.ModuleType):
    """`nn` as the module of mlx-lm's GatedDeltaNet sees it once its convolution runs on the
    kernels: mlx.nn, except that nn.silu returns the convolution's output as it is when the
    kernel has applied the SiLU already (MLX's Linux build computes exp one value at a time: ~23
    ms a layer for a 256-token prompt on one core). Any other array, and every other name, is
    mlx.nn's. mixbit does not copy mlx-lm's forward; this is the one seam inside it."""

    def __init__(self, nn):
        super().__init__(nn.__name__)
        self._nn = nn

    def __getattr__(self, name):
        return getattr(self._nn, name)

    def silu(self, x):
        if getattr(_silu_done, "y", None) is x:
            _silu_done.y = None
            return x
        return self._nn.silu(x)


def _silu_follows_conv(module) -> bool:
    """Whether `module`'s forward applies nn.silu straight to its conv1d's output (mlx-lm's
    GatedDeltaNet: `nn.silu(self.conv1d(conv_input))`), read from its source."""
    import inspect

    try:
        src = inspect.getsource(type(module).__call__)
    except (OSError, TypeError):
        return False
    return "nn.silu(self.conv1d(" in src.replace(" ", "")


def _install_silu_done(module) -> None:
    """Routes `nn` of the module that defines `module`'s class (mlx-lm's qwen3_5) through
    _SiluDone, once."""
    import sys

    namespace = sys.modules.get(type(module).__module__)
    nn = getattr(namespace, "nn", None)
    if nn is not None and not isinstance(nn, _SiluDone):
        namespace.nn = _SiluDone(nn)


try:
    _PackedLinear, _PackedEmbedding, _Bf16Linear, _Bf16Embedding, _DepthwiseConv1d = _classes()
    _ACTIVATED = _activated_classes()
except ImportError:  # mlx missing: nothing to install into
    _PackedLinear = _PackedEmbedding = _Bf16Linear = _Bf16Embedding = _DepthwiseConv1d = None
    _ACTIVATED = {}


def served(module) -> bool:
    """Whether `module` runs on these kernels (forward only: MLX cannot differentiate them)."""
    kinds = tuple(k for k in (_PackedLinear, _PackedEmbedding, _Bf16Linear, _Bf16Embedding, _DepthwiseConv1d,
                              *_ACTIVATED.values()) if k)
    return bool(kinds) and isinstance(module, kinds)
