"""The embedded model's per-tensor sensitivity, ranked, and the cheap estimator against it.

    .venv/bin/python tests/bench/sensitivity_bench.py [--out docs/sensitivity.json]

Measures the ablation table (one tensor fake-quantized at a time, KL(bf16 || quantized) on the
built-in calibration rows, bits 2-8 at group 64), the diagonal-Fisher estimate, and the streamed
probe estimator (quant/probe.py) with every tensor probed and with a small time budget
(`--probe-budget`, default 5 s: a handful of probes, the rest interpolated), on the same rows;
prints the tensor-class ranking at 3 and 4 bits (where linear_attn.out_proj falls), the 15 most
and least sensitive tensors at 4 bits, and Spearman's rho of each estimate against the ablation
with its cost.
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
    ap.add_argument("--probe-budget", type=float, default=5.0)
    args = ap.parse_args()
    lm = load(resolve(args.model))
    cal = calib.build(lm.tokenizer, n_rows=16, length=128)
    t = time.time()
    ablation = measure(lm.model, cal)
    t_abl = time.time() - t
    t = time.time()
    fisher = fisher_estimate(lm.model, cal)
    t_fis = time.time() - t
    from mixbit.quant.probe import estimate, first_pass
    from mixbit.quant.stream import LayerStream

    t = time.time()
    stream = LayerStream(resolve(args.model).path)
    fp = first_pass(stream, cal.rows)
    t_first = time.time() - t
    t = time.time()
    probe_all = estimate(stream, fp, 1e9)
    t_all = time.time() - t + t_first
    t = time.time()
    probe_few = estimate(stream, fp, args.probe_budget)
    t_few = time.time() - t + t_first
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
    print("\n| estimate | probes | Spearman rho, all pairs | q3g64 | q4g64 | seconds | vs ablation |")
    print("|---|---|---|---|---|---|---|")
    rhos = {}
    for name, table, secs in (("Fisher (whole model in memory)", fisher, t_fis),
                              ("probe, every tensor (streamed)", probe_all, t_all),
                              (f"probe, {args.probe_budget:g} s budget (streamed)", probe_few, t_few)):
        rho, n = spearman(ablation, table)
        rhos[name] = rho
        print(f"| {name} | {table.meta.get('probes', '-')} | {rho:.3f} ({n}) | "
              f"{spearman(ablation, table, 'q3g64')[0]:.3f} | {spearman(ablation, table, 'q4g64')[0]:.3f} | "
              f"{secs:.1f} | {t_abl / secs:.1f}x cheaper |")
    if args.out:
        Path(args.out).write_text(json.dumps({"ablation": ablation.to_json(), "fisher": fisher.to_json(),
                                              "probe_all": probe_all.to_json(), "probe_budget": probe_few.to_json(),
                                              "spearman": rho_all, "spearman_all": rhos,
                                              "seconds": {"ablation": t_abl, "fisher": t_fis,
                                                          "probe_all": t_all, "probe_budget": t_few}},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
