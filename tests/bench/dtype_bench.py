"""Compute dtype on this backend: bf16 against float32, unquantized and 4-bit quantized.

    .venv/bin/python tests/bench/dtype_bench.py [--model models/tiny-qwen3.5]

Prints prefill time for a 512-token prompt and single-stream decode tokens/s for each combination,
which is what `generation.compute_dtype = "auto"` chooses from (float32 on CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]


def timed(model, tokens: list[int], decode: int = 128) -> tuple[float, float]:
    from mlx_lm.generate import generate_step

    prompt = mx.array(tokens)
    start = time.perf_counter()
    first = None
    n = 0
    for _tok, _ in generate_step(prompt, model, max_tokens=decode):
        if first is None:
            first = time.perf_counter()
        n += 1
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3.5"))
    args = ap.parse_args()
    from mlx_lm import convert

    from mixbit.models.loading import load_tokenizer

    def load(path):  # mixbit's forward (GatedDeltaNet on the kernels), layers left as MLX's own
        from mlx_lm.utils import load_model

        from mixbit.models.forward.qwen3_5 import model_classes

        model, _ = load_model(Path(path), get_model_classes=model_classes)
        return model, load_tokenizer(path)[0]

    q4 = Path(tempfile.mkdtemp()) / "q4"
    convert(args.model, mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=64)
    rows = []
    for name, path in (("bf16 weights", args.model), ("4-bit g64", str(q4))):
        for dtype in ("bfloat16", "float32"):
            model, tok = load(path)
            model.set_dtype(getattr(mx, dtype), lambda d: mx.issubdtype(d, mx.floating))
            tokens = tok.encode("What's the weather in Oslo? " * 60)[:512]
            timed(model, tokens[:64], 8)  # warm-up
            prefill, decode = timed(model, tokens)
            rows.append((name, dtype, prefill, decode))
    print("| weights | compute dtype | prefill 512 tokens (s) | decode tok/s |")
    print("|---|---|---|---|")
    for name, dtype, prefill, decode in rows:
        print(f"| {name} | {dtype} | {prefill:.3f} | {decode:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
