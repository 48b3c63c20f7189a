"""How far the kernels' integer activations (generation.cpu_activations = "int16", "int8") move a
trained model's outputs, against the exact float32 kernels and against quantization itself.

    .venv/bin/python tests/bench/activations_kld.py [--bits 4] [--rows 4] [--tokens 192]

The embedded model is quantized (mlx_lm.convert, `--bits`, group 64) into a temporary folder and
served packed with every projection and the tied head on the kernels (a rule plan, plan.rule_plan(...,
small=0)), once per activation setting; calibration text (quant.calibration, the chat, code and
tool-calling corpus) is decoded one token at a time, so every product is a decode row, and then
run as whole prompts, teacher-forced as fidelity checks and prompt logprobs run (prompt rows;
int8 keeps 16-bit activations there: the SCORE phase), and as a server runs a request:
half of each row prefilled (int8: 8-bit activations), the rest decoded on the state the
prompt left. Prints KLD(mean, max) and top-1 agreement of: the variant against the bf16 model
with each setting, and each integer setting against float32 on the same variant.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=192)
    args = ap.parse_args(argv)

    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    import mlx.core as mx
    from mlx_lm import convert
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mixbit.models import kernels
    from mixbit.models.forward.plan import rule_plan
    from mixbit.models.forward.qwen3_5 import build, model_classes
    from mixbit.models.loading import load_tokenizer
    from mixbit.models.registry import resolve
    from mixbit.quant import calibration

    if not kernels.info().get("vnni"):
        print(f"no AVX-512 VNNI here ({kernels.info()}): the int16 setting computes as float32")
        return 0
    src = resolve("embedded:tiny-qwen3.5").path
    variant = Path(tempfile.mkdtemp()) / "variant"
    convert(str(src), mlx_path=str(variant), quantize=True, q_bits=args.bits, q_group_size=64)

    def model_for(path, activations=None):
        model, _ = load_model(Path(path), get_model_classes=model_classes)
        model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
        build(model, rule_plan(model, activations, small=0) if activations else None)
        return model, load_tokenizer(path)[0]

    reference, tokenizer = model_for(src)
    rows = calibration.build(tokenizer, n_rows=args.rows, length=args.tokens, seed=99).rows

    def decoded_logits(model):
        out = []
        for r in range(rows.shape[0]):
            cache = make_prompt_cache(model)
            for t in range(rows.shape[1]):
                out.append(model(rows[r:r + 1, t:t + 1], cache=cache)[0, -1])
                mx.eval(out[-1])
        return mx.stack(out)

    def compare(p, q):
        lp = p - mx.logsumexp(p, -1, keepdims=True)
        lq = q - mx.logsumexp(q, -1, keepdims=True)
        kld = (mx.exp(lp) * (lp - lq)).sum(-1)
        top1 = (p.argmax(-1) == q.argmax(-1)).astype(mx.float32).mean()
        return f"{kld.mean().item():.3g} | {kld.max().item():.3g} | {100 * top1.item():.1f}%"

    def prompt_logits(model):  # every row as one prompt: all its positions' products are prompt rows
        out = []
        for r in range(rows.shape[0]):
            out.append(model(rows[r:r + 1], cache=make_prompt_cache(model), phase="score")[0])
            mx.eval(out[-1])
        return mx.concatenate(out)

    def served_logits(model):  # as a server runs a request: the first half prefilled as a prompt
        # (its logits unread), the rest decoded one token at a time on the state it left
        half = rows.shape[1] // 2
        out = []
        for r in range(rows.shape[0]):
            cache = make_prompt_cache(model)
            model(rows[r:r + 1, :half], cache=cache, phase="prefill")
            mx.eval([c.state for c in cache])
            for t in range(half, rows.shape[1]):
                out.append(model(rows[r:r + 1, t:t + 1], cache=cache)[0, -1])
                mx.eval(out[-1])
        return mx.stack(out)

    settings = ("float32", "int16", "int8")
    models = {a: model_for(variant, a)[0] for a in settings}
    for title, run in (("decoded one at a time (decode rows)", decoded_logits),
                       ("each row as one prompt, teacher-forced as a fidelity check scores it (prompt rows, "
                        "the head included)", prompt_logits),
                       ("as served: the first half a prompt, the second half decoded on its state (logits of "
                        "the decoded half)", served_logits)):
        ref = run(reference)
        got = {a: run(models[a]) for a in settings}
        print(f"\n{args.rows} x {args.tokens} tokens {title}, {args.bits}-bit variant (group 64)\n")
        print("| | KLD mean | KLD max | top-1 agreement |\n|---|---|---|---|")
        for a in settings:
            print(f"| variant vs the bf16 model, {a} activations | {compare(ref, got[a])} |")
        for a in settings[1:]:
            print(f"| {a} vs float32 activations, the same variant | {compare(got['float32'], got[a])} |")
            diff = mx.abs(got["float32"] - got[a]).max().item()
            print(f"| (largest logit difference {a} - float32: {diff:.3g}, logits up to "
                  f"{mx.abs(got['float32']).max().item():.3g}) | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
