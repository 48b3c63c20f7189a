"""CPU: quantized_matmul against dequantize-then-BLAS, by the number of rows multiplied.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python tests/bench/qmm_bench.py

MLX's CPU quantized_matmul has no BLAS path: its cost grows with every row of the input, so a
500-token prefill through quantized weights is slow, while one decode row is as fast as a dense
GEMV. Dequantizing the weight (transiently) and calling the float32 matmul pays O(weight) once per
call and then runs at BLAS speed. This prints both, per shape and row count, and the row count
above which dequantizing wins (models/loading.py's packed CPU path uses it); then whole forward
passes of the embedded model's mixbit-auto variant in each CPU mode.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

SHAPES = {  # (out, in): the embedded model's projections and a 2B-class Qwen3.5 MLP
    "tiny in_proj_qkv 256->1024": (1024, 256),
    "tiny mlp up 256->768": (768, 256),
    "tiny mlp down 768->256": (256, 768),
    "tiny head 256->vocab 4096": (4096, 256),
    "2B mlp up 2048->6144": (6144, 2048),
}


def timeit(fn, reps: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            mx.eval(fn())
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def model_table(reps: int = 20) -> None:
    """The embedded model's mixbit-auto variant, whole forward passes: a 512-token prefill and one
    decode step at batch 1/4/8/16, for the three ways to run quantized layers on CPU."""
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve
    from mixbit.quant.variants import ensure_variant
    from mlx_lm.models.cache import make_prompt_cache

    resolved = resolve("embedded:tiny-qwen3.5")
    variant = ensure_variant(resolved, "mixbit-auto", "~/.cache/mixbit")
    modes = {
        "bf16 checkpoint, dense float32": load(resolved).model,
        "quantized kernels only": load(resolved, path=variant.path, cpu_quantized="packed").model,
        "packed, dequantized per call past the crossover (cpu_quantized=packed)":
            load(resolved, path=variant.path, cpu_quantized="packed").model,
        "dequantized once at load (cpu_quantized=dense; auto here)":
            load(resolved, path=variant.path, cpu_quantized="dense").model,
    }
    for _, m in modes["quantized kernels only"].named_modules():
        if hasattr(m, "_dense_rows"):
            m._dense_rows = 1 << 30
    print("\n| model | prefill 512 tokens (ms) | decode step b=1 (ms) | b=4 | b=8 | b=16 |")
    print("|---|---|---|---|---|---|")
    for name, model in modes.items():
        prompt = mx.array([list(range(10, 522))])
        pre = timeit(lambda: model(prompt), 3)
        steps = []
        for b in (1, 4, 8, 16):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([list(range(10, 74))] * b), cache=cache))
            tok = mx.array([[7]] * b)
            # the step is timed on a cache that grows by one token per call, as decode does
            steps.append(timeit(lambda: model(tok, cache=cache), reps))
        print(f"| {name} | {pre * 1e3:.1f} | " + " | ".join(f"{t * 1e3:.2f}" for t in steps) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,128,512")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--model-only", action="store_true", help="only the whole-model table")
    args = ap.parse_args()
    if args.model_only:
        model_table()
        return 0
    mx.set_default_device(mx.cpu)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"| shape | rows | quantized_matmul (ms) | dequantize + matmul (ms) | faster |")
    print("|---|---|---|---|---|")
    for name, (n_out, n_in) in SHAPES.items():
        w = mx.random.normal((n_out, n_in)) * 0.02
        q, s, b = mx.quantize(w, group_size=64, bits=args.bits)
        mx.eval(q, s, b)
        for m in rows:
            x = mx.random.normal((1, m, n_in))
            reps = max(3, int(2000 / (m * n_out * n_in / 1e6 + 1)))
            reps = min(reps, 200)
            tq = timeit(lambda: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=args.bits), reps)
            td = timeit(lambda: x @ mx.dequantize(q, s, b, group_size=64, bits=args.bits).T, reps)
            print(f"| {name} | {m} | {tq * 1e3:.3f} | {td * 1e3:.3f} | {'dequantize' if td < tq else 'quantized'} x{max(tq, td) / min(tq, td):.1f} |")
    model_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
