"""mixbit's packed-weight kernels on each instruction-set path this CPU can run, against dense
float32 (OpenBLAS, as MLX computes it after `mixbit.models.blas` loads it) and MLX's own CPU
`quantized_matmul`, at Qwen3.5-0.8B's and 2B's projection shapes and recipe widths.

    .venv/bin/python tests/bench/isa_bench.py [--rows 1,8] [--prompt 256] [--shapes 0.8b,2b]

Decode rows run the FLOAT mode (float32 FMAs over the weights unpacked in registers), prompts
the BLAS mode (dequantized tiles, then cblas_sgemm). Paths: `native` (all the CPU has: AVX-512
VBMI where present), `avx2` (AVX2 + FMA, what CPUs without AVX-512 run), `portable` (C). The CPU
plan (models/forward/plan.py) makes the same comparison per layer shape at a variant's first
start and serves a shape packed where its kernel beats dense float32; on a CPU with only the
portable path every shape lost, so a variant was served dense (7x its bytes in memory).
Prints one markdown table, milliseconds per call (median of --reps).
"""

from __future__ import annotations

import argparse
import statistics
import time

from mixbit.models.blas import ensure_fast_blas

ensure_fast_blas()  # before MLX: its bundled reference BLAS is ~10x slower

import mlx.core as mx  # noqa: E402

from mixbit.models import kernels  # noqa: E402

SHAPES = {  # (out, in, bits, group): projections of the shapes' mixbit-auto variants
    "0.8b": [("in_proj_qkv", 6144, 1024, 3, 128), ("mlp gate/up", 3584, 1024, 4, 128),
             ("mlp down", 1024, 3584, 4, 128), ("out_proj", 1024, 2048, 6, 64),
             ("head (tied)", 248320, 1024, 5, 64), ("bf16 kept", 3584, 1024, 16, 0)],
    "2b": [("mlp gate/up", 6144, 2048, 4, 128), ("mlp down", 2048, 6144, 3, 128),
           ("in_proj_qkv", 8192, 2048, 5, 64)],
}


def median_ms(fn, reps: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def paths() -> list[str]:
    """The kernel paths this CPU runs, fastest first."""
    found = []
    for isa in ("native", "avx2", "portable"):
        kernels._qkernel.force_isa(isa)
        name = kernels.info()["isa"]
        if name not in [n for _, n in found]:
            found.append((isa, name))
    kernels._qkernel.force_isa("native")
    return [isa for isa, _ in found]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.8b,2b")
    ap.add_argument("--rows", default="1,8", help="decode rows (FLOAT mode)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt rows (BLAS mode); 0: none")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    if not kernels.available():
        raise SystemExit(f"no kernels: {kernels.IMPORT_ERROR}")
    kernels.start()
    isas = paths()
    names = {}
    for isa in isas:
        kernels._qkernel.force_isa(isa)
        names[isa] = kernels.info()["isa"]
    kernels._qkernel.force_isa("native")
    print(f"kernels: {', '.join(f'{i} = {names[i]}' for i in isas)}; threads {kernels.threads()}; "
          f"BLAS {'OpenBLAS' if kernels.blas_available() else 'none'}\n")
    rows = [int(r) for r in args.rows.split(",") if r] + ([args.prompt] if args.prompt else [])
    head = ["shape", "projection", "out x in", "bits", "rows", "dense f32", "MLX qmm"] + \
        [f"kernel {names[i]}" for i in isas]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for shape in [s for s in args.shapes.split(",") if s]:
        for name, n, k, bits, group in SHAPES[shape]:
            mx.random.seed(0)
            w = mx.random.normal((n, k)) * 0.05
            if bits == 16:
                packed, scales, biases = w.astype(mx.bfloat16), None, None
                qmm = None
            else:
                packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
                qmm = (packed, scales, biases)
            dense = w.astype(mx.float32)
            mx.eval(packed, dense, *(qmm or ()))
            s32 = scales.astype(mx.float32) if scales is not None else None
            b32 = biases.astype(mx.float32) if biases is not None else None
            del w
            for m in rows:
                x = mx.random.normal((m, k))
                mx.eval(x)
                reps = args.reps if n * k * m < 2e9 else 3
                cells = [median_ms(lambda: x @ dense.T, reps)]
                cells.append(median_ms(lambda: mx.quantized_matmul(x, *qmm, transpose=True, group_size=group,
                                                                   bits=bits), max(1, reps // 3))
                             if qmm and m <= 8 else None)
                mode = kernels.FLOAT if m <= 8 else kernels.BLAS
                for isa in isas:
                    kernels._qkernel.force_isa(isa)
                    slow = names[isa] == "portable" and mode == kernels.FLOAT
                    cells.append(median_ms(lambda: kernels.matmul(x, packed, s32, b32, bits, group, mode=mode),
                                           max(1, reps // 3) if slow else reps))
                kernels._qkernel.force_isa("native")
                print(f"| {shape} | {name} | {n} x {k} | {bits} | {m} | " +
                      " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |", flush=True)
            del dense, packed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
