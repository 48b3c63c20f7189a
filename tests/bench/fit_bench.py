"""What the writer's fitted quantization costs against MLX's round-to-nearest, per weight of a real
Qwen3.5 shape, in one run:

    .venv/bin/python tests/bench/fit_bench.py [--rows 12288] [--cols 4096] [--formats q3g64,q4g64,q5g64,q6g64,q8g64]

For each format: seconds for mx.quantize (round to nearest, what the sensitivity passes estimate
with), for quant.formats.quantize (the fit, what a variant is written with) in MLX on one and on
two CPU streams and on mixbit's kernels (what the writer runs where they are built; the same bits,
checked here), and the squared error of each against the weight (the fit is never worse).
Random Gaussian weights at the 9B shape's MLP width by default (12288 x 4096, 50M weights): time
and error ratios, not a model's quality (docs/sizes.md has what the fit costs a first start).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx

    from mixbit.quant import formats as F

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--formats", default="q3g64,q4g64,q5g64,q6g64,q8g64")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the fastest is kept")
    args = ap.parse_args(argv)
    mx.random.seed(0)
    w = (mx.random.normal((args.rows, args.cols)) * 0.02).astype(mx.bfloat16)
    mx.eval(w)
    x = w.astype(mx.float32)

    def best(fn):
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            out = fn()
            mx.eval(out)
            times.append(time.perf_counter() - t)
        return min(times), out

    def sq_error(packed, scales, biases, fmt):
        d = F.dequantize(packed, scales, biases, fmt) - x
        return float((d * d).mean().item())

    print(f"\n{args.rows} x {args.cols} bf16 weight ({args.rows * args.cols / 1e6:.0f}M weights), "
          f"{F.FIT_ELEMENTS >> 20}M-weight chunks\n")
    from mixbit.models import kernels

    print("| format | round to nearest (mx.quantize) | fitted in MLX, one stream | two streams "
          "| fitted on the kernels | kernels / MLX two streams | kernel fit / RTN time | squared error, fitted / RTN |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        fmt = F.Format.parse(name)
        rtn_s, rtn = best(lambda: mx.quantize(w, group_size=fmt.group_size, bits=fmt.bits))
        one_s, _ = best(lambda: F.quantize(w, fmt, streams=1, kernel=False))
        two_s, fit = best(lambda: F.quantize(w, fmt, streams=2, kernel=False))
        ratio = sq_error(*fit, fmt) / sq_error(*rtn, fmt)
        if kernels.fit_available():
            k_s, on_kernels = best(lambda: F.quantize(w, fmt))
            if not all(mx.array_equal(a, b).item() for a, b in zip(fit, on_kernels)):
                raise SystemExit(f"{name}: the kernels' fit differs from MLX's")
            cells = f"{k_s:.2f} s | {two_s / k_s:.1f}x faster | {k_s / rtn_s:.1f}x"
        else:
            cells = f"not built here ({kernels.IMPORT_ERROR or 'no fit'}) | | {two_s / rtn_s:.0f}x"
        print(f"| {name} | {rtn_s:.2f} s | {one_s:.2f} s | {two_s:.2f} s | {cells} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
