"""Prompt rows through one packed projection, per path of the kernels: the float32 FMA kernel
(decode's), its 16-bit integer activation twin (INT16, where the CPU has AVX-512 VNNI), the
weight dequantized in tiles and multiplied by OpenBLAS's sgemm (BLAS), INT16's activations against
the weight unpacked into column panels (PANEL, VNNI), and AMX tiles with x split exactly into
three bfloat16 parts (TILES, where the CPU has AMX). One table.

    .venv/bin/python tests/bench/prompt_matmul_bench.py [--rows 256,2048] [--repeat 5]

Shapes are Qwen3.5-0.8B's projections at the bit widths its mixbit-auto variant gives them
(random weights: time only), and its tied head. Each cell is the median of --repeat calls on the
kernels' threads (MIXBIT_KERNEL_THREADS, default: every CPU), with the worst relative error
against a float64 product of the same dequantized weight.
"""

from __future__ import annotations

import argparse
import time

SHAPES = [  # out, in, bits, group: name
    (6144, 1024, 3, 128, "in_proj_qkv"),
    (3584, 1024, 4, 128, "gate/up_proj"),
    (1024, 3584, 4, 128, "down_proj"),
    (1024, 2048, 3, 64, "out_proj"),
    (4096, 1024, 5, 128, "q_proj"),
    (248320, 1024, 5, 64, "head (tied)"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="include the 248,320-row head (slow)")
    args = ap.parse_args(argv)

    from mixbit.models.blas import ensure_fast_blas

    blas = ensure_fast_blas()
    import mlx.core as mx
    import numpy as np

    from mixbit.models import kernels

    kernels.start()
    paths = {"kernel": kernels.FLOAT}
    if kernels.info().get("vnni"):  # decode rows' 16-bit integer activations (cpu_activations)
        paths["INT16"] = kernels.INT16
    if kernels.blas_available():
        paths["BLAS"] = kernels.BLAS
    if kernels.info().get("vnni"):  # the same activations against column panels (many rows)
        paths["PANEL"] = kernels.PANEL
    print(f"kernels {kernels.info()}, BLAS: {blas.name}")
    print("\n| projection | out x in | bits | rows | " + " | ".join(f"{p} ms" for p in paths)
          + " | TILES ms | TILES / best other | TILES max rel. error |")
    print("|---|---|---|---|" + "---|" * (len(paths) + 3))
    for n, k, bits, group, name in SHAPES:
        if n > 100000 and not args.head:
            continue
        w, s, b = mx.quantize(mx.random.normal((n, k)) * 0.05, group_size=group, bits=bits)
        s, b = s.astype(mx.float32), b.astype(mx.float32)
        mx.eval(w, s, b)
        dense = None
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, k))
            mx.eval(x)
            times = {}
            modes = dict(paths)
            if kernels.tiles_support(n, k, bits, group):
                modes["TILES"] = kernels.TILES
            for p, mode in modes.items():
                if p in ("kernel", "INT16") and rows * n * k > 4e9:  # minutes: decode kernels, not for prompts
                    continue
                if p == "PANEL" and not kernels.panel_support(n, k, bits, group):
                    continue
                kernels.matmul(x, w, s, b, bits, group, mode=mode)
                ts = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    kernels.matmul(x, w, s, b, bits, group, mode=mode)
                    ts.append(time.perf_counter() - t)
                times[p] = sorted(ts)[len(ts) // 2] * 1e3
            err = "-"
            if "TILES" in modes and n * k <= 1 << 24:
                if dense is None:
                    dense = np.array(mx.dequantize(w, s, b, group_size=group, bits=bits)).astype(np.float64)
                ref = np.array(x).astype(np.float64) @ dense.T
                got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.TILES))
                err = f"{np.abs(got - ref).max() / np.abs(ref).max():.1e}"
            other = min((v for p, v in times.items() if p != "TILES"), default=float("nan"))
            cells = " | ".join(f"{times[p]:.2f}" if p in times else "-" for p in paths)
            tiles = f"{times['TILES']:.2f}" if "TILES" in times else "-"
            ratio = f"{times['TILES'] / other:.2f}" if "TILES" in times else "-"
            print(f"| {name} | {n} x {k} | {bits} | {rows} | {cells} | {tiles} | {ratio} | {err} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
