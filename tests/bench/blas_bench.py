"""Which BLAS runs MLX's CPU matmuls, and what it costs: one table, every candidate in its own
process (a BLAS can only be chosen before mlx.core loads).

    .venv/bin/python tests/bench/blas_bench.py [--repeat 10]

Rows: MLX's bundled reference BLAS, the cmeel-openblas wheel mixbit loads (models/blas.py), and
a system OpenBLAS when one is installed (Debian's libopenblas0-pthread). Shapes are Qwen3.5-0.8B's
and 2B's: a 512-token prefill through an MLP up-projection, and one decode row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = r"""
import ctypes, json, sys, time
path = sys.argv[1]
if path:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
import mlx.core as mx
out = {}
for rows, k, n in [(512, 1024, 3584), (1, 1024, 3584), (512, 2048, 6144), (1, 2048, 6144)]:
    a = mx.random.normal((rows, k)); b = mx.random.normal((k, n)); mx.eval(a, b)
    for _ in range(2):
        mx.eval(a @ b)
    times = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
    times.sort()
    out[f"{rows}x{k}x{n}"] = 1000 * times[len(times) // 2]
print(json.dumps(out))
"""


def candidates() -> list[tuple[str, str]]:
    sys.path.insert(0, ".")
    from mixbit.models.blas import _system_paths, _wheel_paths

    rows = [("MLX bundled reference BLAS", "")]
    rows += [("cmeel-openblas wheel (mixbit's choice)", p) for p in _wheel_paths()[:1]]
    rows += [("system OpenBLAS", p) for p in _system_paths()[:1]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    results = []
    for name, path in candidates():
        out = subprocess.run([sys.executable, "-c", PROBE, path, str(args.repeat)],
                             capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            results.append((name, path, None, out.stderr.strip().splitlines()[-1]))
            continue
        results.append((name, path, json.loads(out.stdout), ""))
    shapes = next(r[2] for r in results if r[2])
    print("float32 matmul, median ms (rows x in x out)")
    print("| BLAS | " + " | ".join(shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for name, path, times, err in results:
        cells = [f"{times[s]:.1f}" for s in shapes] if times else [f"failed: {err}"] + [""] * (len(shapes) - 1)
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
