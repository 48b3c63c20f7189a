"""Where one decode step and one prefill chunk spend their time, at a real Qwen3.5 shape.

    .venv/bin/python tests/bench/step_profile.py FOLDER [--mode auto|packed|dense] [--batch 1,8]
        [--prefill 256] [--prefill-batch 1]

FOLDER: a checkpoint or a cached variant (e.g. the 0.8B shape's mixbit-auto, see
tests/bench/kernel_serve_bench.py). Loads it through mixbit's own loader (the CPU kernels or dense
float32, `--mode`), then times: whole decode steps (batch 1 and 8), one 256-token prefill chunk,
and the same steps with every module synchronised (mx.eval after each) to attribute the time:
projections (per kind), the GatedDeltaNet recurrence and conv (the linear-attention layer minus
its projections), gated attention (the attention layer minus its projections), MLP activation,
the head, and the rest (norms, residuals, embedding). Then sampling over the full vocabulary:
greedy, top-p/top-k, logprobs. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path


def _timed(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--mode", default="auto", choices=["auto", "packed", "dense"])
    ap.add_argument("--activations", default="auto", choices=["auto", "float32", "int16"],
                    help="generation.cpu_activations: the decode kernels' activations")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--prefill-batch", type=int, default=1,
                    help="prompts sharing the prefill chunk, --prefill tokens in all (the engine cuts a "
                         "512-token round over 8 prompts into 8 x 64)")
    args = ap.parse_args(argv)

    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from mixbit.models import kernels
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    t0 = time.perf_counter()
    lm = load(resolve(args.folder, allow_download=False), path=Path(args.folder), cpu_quantized=args.mode,
              cpu_activations=args.activations)
    model = lm.model
    from mixbit.server.engine import keep_step_buffers

    keep_step_buffers(model, max(int(b) for b in args.batch.split(",")))  # as the engine does
    print(f"loaded in {time.perf_counter() - t0:.1f} s; kernels {kernels.info()}")
    if lm.cpu_plan:
        print("\n| out | in | bits | group | runs | decode activations | kernel ms (1 row) | dense ms (1 row) | "
              "prompt from rows | prompt path |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in lm.cpu_plan["shapes"]:
            print(f"| {r['out']} | {r['in']} | {r['bits']} | {r['group']} | {r['runs']} | {r['decode']} | "
                  f"{r['kernel_ms_1row']} | {r['dense_ms_1row']} | {r['prefill_from_rows']} | {r['prefill']} |")
    vocab = getattr(model, "language_model", model).model.embed_tokens.weight.shape[0]

    def fresh(batch, length=32):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((batch, length), dtype=mx.int32) + 7, cache=cache))
        return cache

    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        cache = fresh(b)
        tok = mx.zeros((b, 1), dtype=mx.int32) + 11

        def step():
            mx.eval(model(tok, cache=cache))

        rows.append((f"decode step, batch {b}", _timed(step, 8)))
    cache = fresh(1)
    per = args.prefill // args.prefill_batch
    chunk = (mx.arange(per * args.prefill_batch, dtype=mx.int32) % 1000 + 5).reshape(args.prefill_batch, per)
    chunk_name = (f"prefill chunk of {args.prefill} tokens" if args.prefill_batch == 1
                  else f"prefill chunk of {args.prefill_batch} x {per} tokens")

    def prefill():  # as the engine prefills: for the cache; the prompt's logits stay unevaluated
        c = make_prompt_cache(model)
        model(chunk, cache=c, phase="prefill")
        mx.eval([s.state for s in c])

    rows.append((chunk_name, _timed(prefill, 2)))
    print("\n| step | ms |\n|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.1f} |")

    # attribution: wrap modules, synchronise after each
    times = defaultdict(float)
    from mixbit.models.forward.layers import PREFILL, Projection

    projections = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding, Projection)
    originals = {}

    def label(path, module):
        if "embed_tokens" in path:
            return "embedding lookup"
        last = path.rsplit(".", 1)[-1]
        return f"projection {last}"

    def wrap(cls, name_of):
        orig = cls.__call__
        originals[cls] = orig

        def call(self, *a, **k):
            mx.eval(a[0]) if a and isinstance(a[0], mx.array) else None
            t = time.perf_counter()
            out = orig(self, *a, **k)
            mx.eval(out)
            times[name_of(self)] += time.perf_counter() - t
            return out
        cls.__call__ = call

    def kind_of(cls):  # mixbit's layer classes (models/forward/qwen3_5.py)
        return next((c.__name__ for c in cls.__mro__ if c.__name__ in ("GatedDeltaNet", "Attention", "MLP")), None)

    paths = {id(m): p for p, m in model.named_modules()}
    wrapped = set()
    for _, m in model.named_modules():
        cls = type(m)
        if cls in wrapped:
            continue
        if isinstance(m, projections):
            wrap(cls, lambda s: label(paths.get(id(s), ""), s))
            wrapped.add(cls)
        elif kind_of(cls):
            wrap(cls, lambda s: f"layer {kind_of(type(s))}")
            wrapped.add(cls)
    lang = getattr(model, "language_model", model)
    head_owner = lang.model.embed_tokens if not hasattr(lang, "lm_head") else None
    if head_owner is not None:
        orig_head = type(head_owner).as_linear

        def as_linear(self, x, phase=None):
            mx.eval(x)
            t = time.perf_counter()
            out = orig_head(self, x, phase) if isinstance(self, Projection) else orig_head(self, x)
            lazy = phase == PREFILL or (phase is None and x.shape[-2] > 1)
            if not lazy:  # a prompt's head stays unevaluated, as in the engine
                mx.eval(out)
            times["head"] += time.perf_counter() - t
            return out
        type(head_owner).as_linear = as_linear

    def attribute(title, run, reps):
        run()
        times.clear()
        t = time.perf_counter()
        for _ in range(reps):
            run()
        total = (time.perf_counter() - t) / reps
        proj = {k: v / reps for k, v in times.items() if k.startswith("projection")}
        layer = {k: v / reps for k, v in times.items() if k.startswith("layer")}
        print(f"\n### {title}, every module synchronised: {total * 1e3:.1f} ms\n")
        print("| part | ms | share |\n|---|---|---|")
        # a layer's own time minus the projections it calls
        own = {"GatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
               "Attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "MLP": ("gate_proj", "up_proj", "down_proj")}
        names = {"GatedDeltaNet": "GatedDeltaNet recurrence, conv, norm",
                 "Attention": "attention core (RoPE, SDPA, gate)",
                 "MLP": "MLP activation"}
        parts = {}
        for kind, inner_names in own.items():
            inner = sum(proj.get(f"projection {n}", 0.0) for n in inner_names)
            if f"layer {kind}" in layer:
                parts[names[kind]] = layer[f"layer {kind}"] - inner
        for k, v in sorted(proj.items()):
            parts[k] = v
        parts["head (tied embedding)"] = times.get("head", 0.0) / reps
        parts["rest (norms, residuals, embedding, Python)"] = total - sum(parts.values())
        for k, v in parts.items():
            print(f"| {k} | {v * 1e3:.2f} | {100 * v / total:.0f}% |")

    for b in [int(x) for x in args.batch.split(",")]:
        cache = fresh(b)
        tok = mx.zeros((b, 1), dtype=mx.int32) + 11
        attribute(f"decode step, batch {b}", lambda: mx.eval(model(tok, cache=cache)), 4)
    attribute(chunk_name, prefill, 1)

    # sampling over the full vocabulary
    from mlx_lm.sample_utils import make_sampler

    from mixbit.server.sampling import SamplingParams
    from mixbit.server.sampling import make_sampler as mixbit_sampler

    v = vocab or 248320
    # peaked like a trained model's next-token distribution (a nucleus of tens of tokens), and
    # flat like a random-weight model's (the nucleus is most of the vocabulary)
    peaked = mx.random.normal((1, v)) * 4
    flat = mx.random.normal((1, v)) * 0.5
    peaked, flat = (x - mx.logsumexp(x, -1, keepdims=True) for x in (peaked, flat))
    mx.eval(peaked, flat)
    samplers = {
        "greedy (argmax)": (lambda x: mx.argmax(x, -1), peaked),
        "temperature 0.7": (make_sampler(temp=0.7), peaked),
        "top_p 0.9, mlx-lm (full sort)": (make_sampler(temp=0.7, top_p=0.9), peaked),
        "top_p 0.9, mixbit, peaked row": (mixbit_sampler(SamplingParams(temperature=0.7, top_p=0.9)), peaked),
        "top_p 0.9, mixbit, flat row (falls back)": (mixbit_sampler(SamplingParams(temperature=0.7, top_p=0.9)),
                                                     flat),
        "top_k 40": (make_sampler(temp=0.7, top_k=40), peaked),
        "logprobs (log-softmax), MLX": (lambda x: x - mx.logsumexp(x, -1, keepdims=True), peaked),
        "logprobs (log-softmax), kernels (the decode loop)": (
            lambda x: x - kernels.logsumexp(x, -1, keepdims=True), peaked),
    }
    print(f"\n### sampling over {v} tokens (one row)\n\n| sampler | ms |\n|---|---|")
    for name, (fn, row) in samplers.items():
        ms = _timed(lambda: mx.eval(fn(row)), 10) * 1e3
        print(f"| {name} | {ms:.2f} |")
    # the decode loop normalises every row of every decode step, whatever the sampler
    rows8 = mx.concatenate([peaked] * 8)
    mx.eval(rows8)
    print("\n| log-sum-exp of a decode step's logits, batch 8 | ms |\n|---|---|")
    for name, fn in (("MLX (`mx.logsumexp`)", mx.logsumexp), ("kernels (`kernels.logsumexp`)", kernels.logsumexp)):
        print(f"| {name} | {_timed(lambda: mx.eval(fn(rows8, -1, keepdims=True)), 10) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
