"""How many bits the MTP head's linears need: its drafts' agreement with the model, by precision.

    .venv/bin/python tests/bench/mtp_head_bits.py [--model models/tiny-qwen3.5] [--rows 16]

The embedded model (bf16, frozen) and its trained MTP head; the head's linear weights (fc, the
attention and MLP projections of its layer) rounded to each format (MLX's affine quantization,
as the variants store them) while the model and the shared output head stay as they are. Printed
per format: the share of held-out assistant positions where the head's first choice of the
token after next is the model's (the greedy acceptance of a one-token draft, teacher-forced),
and the mean KL of the model's distribution to the head's. quant/writer.py stores the head of
every variant in the format this table picked (docs/speculative.md has the numbers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FORMATS = [(16, 0), (8, 64), (6, 64), (5, 64), (4, 64), (4, 32), (3, 64)]


def load_head(folder: Path):
    """The checkpoint's MTP head, float32 and unbuilt (its projections MLX's own)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from mixbit.models.forward.qwen3_5 import model_classes

    model, _ = load_model(folder, get_model_classes=model_classes)
    head = model.detach_mtp()
    if head is None:
        raise SystemExit(f"{folder} has no MTP head (mixbit train-mtp adds one)")
    head.set_dtype(mx.float32)
    return head


def rounded(head, bits: int, group: int):
    """A copy of `head` with every 2-d linear weight quantized and dequantized."""
    import copy

    import mlx.core as mx
    import mlx.nn as nn

    out = copy.deepcopy(head)
    if bits == 16:
        return out
    updates = []
    for name, w in nn.utils.tree_flatten(out.parameters()):
        if name.endswith(".weight") and w.ndim == 2 and "norm" not in name and w.shape[-1] % group == 0:
            q, s, b = mx.quantize(w, group_size=group, bits=bits)
            updates.append((name, mx.dequantize(q, s, b, group_size=group, bits=bits)))
    out.load_weights(updates, strict=False)
    mx.eval(out.parameters())
    return out


def main(argv=None) -> int:
    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    from mixbit.models.training.mtp import MtpConfig, _batch, _corpus, agreement, load_frozen

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3.5"))
    ap.add_argument("--rows", type=int, default=16, help="held-out rows of the corpus (1,024 tokens each)")
    args = ap.parse_args(argv)
    folder = Path(args.model)
    cfg = MtpConfig(model=str(folder))
    model, head = load_frozen(folder), load_head(folder)
    tc, tokenizer, fast = _corpus(cfg, folder)
    held = [_batch(tc, 10**6 + i, tokenizer, fast) for i in range(max(1, args.rows // cfg.rows))]
    print("| head linears | agreement with the model (teacher-forced k=1 acceptance) | KL(model || head) |")
    print("|---|---|---|")
    for bits, group in FORMATS:
        h = rounded(head, bits, group)
        scores = [agreement(model, h, r, w) for r, w in held]
        acc = sum(a for a, _ in scores) / len(scores)
        kl = sum(k for _, k in scores) / len(scores)
        label = "bf16" if bits == 16 else f"{bits}-bit, group {group}"
        print(f"| {label} | {acc:.4f} | {kl:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
