"""The embedded model's per-tensor sensitivity, ranked, and the cheap estimator against it.

    .venv/bin/python tests/bench/sensitivity_bench.py [--out docs/sensitivity.json]

Measures the ablation table (one tensor fake-quantized at a time, KL(bf16 || quantized) on the
built-in calibration rows, bits 2-8 at group 64) and the diagonal-Fisher estimate on the same rows,
prints the tensor-class ranking at 3 and 4 bits (where linear_attn.out_proj falls), the 15 most
and least sensitive tensors at 4 bits, and Spearman's rho between the two methods with their cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve
    from mixbit.quant import calibration as calib
    from mixbit.quant.formats import tensor_class
    from mixbit.quant.sensitivity import fisher_estimate, measure, spearman

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:tiny-qwen3.5")
    ap.add_argument("--out")
    args = ap.parse_args()
    lm = load(resolve(args.model))
    cal = calib.build(lm.tokenizer, n_rows=16, length=128)
    t = time.time()
    ablation = measure(lm.model, cal)
    t_abl = time.time() - t
    t = time.time()
    fisher = fisher_estimate(lm.model, cal)
    t_fis = time.time() - t
    for fmt in ("q3g64", "q4g64"):
        print(f"\ntensor classes by mean KLD at {fmt} (ablation, nats/token):")
        print("| rank | class | mean KLD | Fisher estimate |")
        print("|---|---|---|---|")
        est = dict(fisher.class_ranking(fmt))
        for i, (cls, v) in enumerate(ablation.class_ranking(fmt), 1):
            print(f"| {i} | {cls} | {v:.5f} | {est.get(cls, float('nan')):.5f} |")
    ranked = ablation.ranking("q4g64")
    print("\nmost sensitive tensors at 4 bits:", ", ".join(f"{p.split('model.')[-1]} {v:.4f}" for p, v in ranked[:15]))
    print("least sensitive tensors at 4 bits:", ", ".join(f"{p.split('model.')[-1]} {v:.5f}" for p, v in ranked[-15:]))
    out_proj = [i for i, (p, _) in enumerate(ranked, 1) if tensor_class(p) == "linear_attn.out_proj"]
    print(f"linear_attn.out_proj tensors rank {out_proj} of {len(ranked)} at 4 bits")
    rho_all, n = spearman(ablation, fisher)
    print(f"\nSpearman rho, Fisher estimate vs ablation: {rho_all:.3f} over {n} (tensor, bits) pairs; "
          + ", ".join(f"{f} {spearman(ablation, fisher, f)[0]:.3f}" for f in
                      ("q2g64", "q3g64", "q4g64", "q5g64", "q6g64", "q8g64")))
    print(f"cost: ablation {t_abl:.1f} s, Fisher {t_fis:.1f} s ({t_abl / t_fis:.1f}x cheaper)")
    if args.out:
        Path(args.out).write_text(json.dumps({"ablation": ablation.to_json(), "fisher": fisher.to_json(),
                                              "spearman": rho_all, "seconds": {"ablation": t_abl, "fisher": t_fis}},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
