"""mixbit's forward against mlx-lm's qwen3_5 at a real shape: teacher-forced logits and decode steps.

    .venv/bin/python tests/bench/forward_check.py [--shape 0.8b] [--variants bf16,mixbit-auto]

For the random-weight checkpoint of the shape (tests/bench/real_shapes.py, .cache/shapes/<shape>)
and each cached variant of it (.cache/bench-cache, made by kernel_serve_bench.py), the reference
is stock mlx-lm on the same folder with every quantized layer dequantized to float32; mixbit
loads it as it serves (the CPU plan measured here, packed kernels). Prints, per variant and
phase, the largest logit difference relative to the reference's largest logit, and whether the
argmax agrees everywhere: the bounds the kernel tests hold on the embedded model are 1e-4 (float
activations) and 1e-3 (16-bit integer activations) of the logits' scale.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--variants", default="bf16,mixbit-auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--activations", default="auto", help="generation.cpu_activations for mixbit's plan")
    args = ap.parse_args(argv)

    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load as mlx_load

    from mixbit.models.loading import _dequantize, load
    from mixbit.models.registry import resolve
    from tests.bench.kernel_serve_bench import _variant_folder
    from tests.bench.sizes_bench import checkpoint

    source = checkpoint(args.shape)
    tokens = (mx.arange(args.tokens, dtype=mx.int32)[None] * 7919) % 200000 + 100
    print(f"activations {args.activations}\n\n| variant | phase | max abs diff / max abs logit | argmax agrees |\n"
          "|---|---|---|---|")
    for recipe in [v for v in args.variants.split(",") if v]:
        folder = source if recipe == "bf16" else _variant_folder(recipe, source)
        if folder is None:
            print(f"| {recipe} | (no cached variant: run kernel_serve_bench.py first) | | |")
            continue
        results = {}
        for name in ("reference", "mixbit"):
            if name == "reference":
                model, _ = mlx_load(str(folder))
                model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
                _dequantize(model)
                kw = {}
            else:
                model = load(resolve(str(source), allow_download=False), path=folder,
                             cpu_activations=args.activations).model
                kw = {"phase": "score"} if "phase" in inspect.signature(model.__call__).parameters else {}
            cache = model.make_cache()
            scored = model(tokens, cache=cache, **kw)[0]
            steps = [model(mx.array([[t]]), cache=cache)[0, -1] for t in (11, 12, 13, 14)]
            results[name] = (np.array(scored.astype(mx.float32)), np.array(mx.stack(steps).astype(mx.float32)))
            del model, cache
            mx.clear_cache()
        for i, phase in enumerate(("teacher-forced prompt", "decode steps")):
            ref, got = results["reference"][i], results["mixbit"][i]
            rel = float(np.abs(got - ref).max() / np.abs(ref).max())
            agree = bool((got.argmax(-1) == ref.argmax(-1)).all())
            print(f"| {recipe} | {phase} | {rel:.2e} | {'yes' if agree else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
