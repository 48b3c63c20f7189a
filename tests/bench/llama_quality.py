"""Quality against llama.cpp's quantization: K-quants and i-quants, without and with an importance
matrix, beside mixbit's recipes, on the same held-out tokens and with the same arithmetic.

    .venv/bin/python tests/bench/llama_quality.py            # table; docs/llama-quality.{json,png}

Builds llama.cpp when missing (tests/bench/llama_cpp.py: about 5-15 minutes on 2 cores, once).
The protocol (quant/llama_kld.py): mixbit's bf16 model writes llama-perplexity's
--kl-divergence-base file for `--chunks` held-out chunks of `--ctx` tokens (the built-in held-out
documents through the chat template, the same text `mixbit eval` uses; the second half of each
chunk is scored); llama-perplexity evaluates each GGUF against it, mixbit evaluates each MLX variant
with the same arithmetic. llama.cpp's bf16 GGUF of the same weights (quant/gguf_export.py) against
the same base is the first row: the floor that separates the two frameworks.

GGUF files: `llama-quantize` of that bf16 GGUF to each of `--types`, once without and once with
`llama-imatrix` computed on mixbit's own calibration set (the rows `mixbit-auto` calibrates on).
"export" rows: a mixbit-auto variant's allocation written as llama-quantize's
`--tensor-type-file` (`mixbit export --tensor-types`: each tensor at the ggml type nearest its
bits), quantized with the imatrix: does mixbit's measured sensitivity help llama.cpp users?

Bits per weight everywhere: stored bytes of the model's tensors (embedding, norms, scales
included; the MTP head left out, as the GGUF leaves it out) x 8 / the model's parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mixbit.models.blas import ensure_fast_blas  # noqa: E402
from tests.bench.llama_cpp import build, kl_divergence, tool  # noqa: E402

ensure_fast_blas()  # the BLAS `mixbit` loads, before anything imports mlx (AWQ's search: 20x)

# the list, and the types below Q3_K_S: on a model whose tied embedding is a sixth of it
# (llama-quantize gives a tied embedding the output's q6_K), Q3_K_S lands at 4.0 bits per weight
TYPES = "Q2_K,IQ3_XXS,IQ3_XS,Q3_K_S,Q3_K_M,Q4_K_S,Q4_K_M,Q5_K_M,Q6_K,IQ3_M,IQ4_XS"
MIXBIT = ("uniform-3,uniform-4,unsloth-static,mixbit-auto@3.5,mixbit-auto@4.0,mixbit-auto@4.5,"
          "mixbit-auto@5.5")
# uniform-3/4 as GGUF: the same allocation in both formats, so the two quantizers compare alone
EXPORT = "uniform-3,uniform-4,mixbit-auto@3.5,mixbit-auto@4.0,mixbit-auto@4.5,mixbit-auto@5.5"
WORK = ROOT / ".cache" / "llama-quality"


def model_params(folder: Path) -> int:
    """Parameters of the model a GGUF holds: every tensor but the MTP head and a tied lm_head."""
    from mixbit.quant.checkpoint import Checkpoint
    from mixbit.quant.gguf_export import gguf_names, text_config

    entries = Checkpoint(folder).entries
    return sum(math.prod(entries[n].shape) for n in gguf_names(entries, text_config(folder), mtp=False))


def gguf_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def mlx_bytes(folder: Path) -> int:
    """A variant's stored tensor bytes without the MTP head."""
    from mixbit.quant.checkpoint import Checkpoint

    return sum(e.nbytes for n, e in Checkpoint(folder).entries.items() if not n.startswith(("mtp.", "model.mtp.")))


def run(cmd: list, **kw) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed ({res.returncode}): {(res.stderr or res.stdout)[-1500:]}")
    return res.stdout + res.stderr


def llama_kld(gguf_path: Path, base) -> dict:
    """llama-perplexity --kl-divergence of a GGUF against the base file (a llama_kld.Base)."""
    return kl_divergence(gguf_path, base.path, base.n_ctx)


def quantize(bf16: Path, kind: str, out: Path, imatrix: Path | None = None, types: Path | None = None) -> Path:
    """Made afresh each run (a second at the embedded model's size)."""
    tmp = out.with_name(out.name + ".partial")
    cmd = [tool("llama-quantize")]
    if imatrix:
        cmd += ["--imatrix", imatrix]
    if types:
        cmd += ["--tensor-type-file", types]
    run(cmd + [bf16, tmp, kind, 1])
    os.replace(tmp, out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:tiny-qwen3.5")
    ap.add_argument("--types", default=TYPES, help="llama-quantize types, comma-separated")
    ap.add_argument("--mixbit", default=MIXBIT, help="mixbit eval --variants specs, comma-separated")
    ap.add_argument("--export", default=EXPORT, help="mixbit variants whose allocation goes to llama-quantize")
    ap.add_argument("--chunks", type=int, default=16, help="held-out chunks")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (the second half is scored)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "llama-quality.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "llama-quality.png"))
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from mixbit.models.forward import score
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve
    from mixbit.quant import calibration as calib
    from mixbit.quant.artifact import weights_digest
    from mixbit.quant.compare import build_variant
    from mixbit.quant.gguf_export import tensor_types, write_gguf
    from mixbit.quant.llama_kld import kld, read_base, write_base
    from mixbit.server.settings import Settings

    build(("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-tokenize"))  # tokenize: tests/test_gguf.py
    resolved = resolve(args.model)
    ref = load(resolved)
    n_params = model_params(resolved.path)
    cache_dir = Settings().model.cache_dir
    started = time.time()

    def logits_of(lm):
        return lambda t: np.array(score(lm.model, mx.array(t)[None]).astype(mx.float32)[0])

    held = calib.build(ref.tokenizer, n_rows=args.chunks, length=args.ctx, split="heldout")
    work = WORK / weights_digest(resolved.path, Path(cache_dir).expanduser())[:16]  # per weights
    work.mkdir(parents=True, exist_ok=True)
    base_path = work / f"base-{held.digest[:12]}.bin"
    base = read_base(base_path) if base_path.exists() else write_base(base_path, np.array(held.rows),
                                                                      logits_of(ref))
    print(f"base: {base.n_chunk} chunks x {base.n_ctx} tokens, {base.n_chunk * base.rows_per_chunk} scored "
          f"({time.time() - started:.0f} s)", file=sys.stderr)

    bf16 = work / "bf16.gguf"
    if not bf16.exists():
        write_gguf(resolved.path, bf16, mtp=False)  # the trunk's quality: the MTP head left out
    # the imatrix: mixbit's own calibration rows (what mixbit-auto calibrates on), as text whose
    # special tokens llama-imatrix parses (--parse-special), in chunks of the rows' length
    cal = calib.build(ref.tokenizer, n_rows=16, length=128, split="train")
    cal_text = work / "calibration.txt"
    cal_text.write_text(ref.tokenizer.decode(np.array(cal.rows).reshape(-1).tolist()))
    imatrix = work / "imatrix.gguf"
    if not imatrix.exists():
        run([tool("llama-imatrix"), "-m", bf16, "-f", cal_text, "-o", imatrix, "-c", 128, "-b", 128,
             "--parse-special", "-t", 1, "--chunks", 16])

    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        print(f"{row['name']:<32} {row['framework']:<10} bpw {row['bpw']:.3f}  KLD {row['kld_mean']:.5f}  "
              f"top-1 {row['top1']:.4f}", file=sys.stderr)

    add({"name": "bf16 GGUF", "framework": "llama.cpp", "imatrix": False,
         "bpw": 8 * gguf_bytes(bf16) / n_params, **llama_kld(bf16, base)})
    for kind in [t for t in args.types.split(",") if t]:
        for use in (False, True):
            try:
                path = quantize(bf16, kind, work / f"{kind}{'-imat' if use else ''}.gguf", imatrix if use else None)
            except RuntimeError as exc:  # e.g. a type that needs an importance matrix
                print(f"{kind}{' +imatrix' if use else ''}: {exc}", file=sys.stderr)
                continue
            add({"name": kind + (" +imatrix" if use else ""), "framework": "llama.cpp", "imatrix": use,
                 "bpw": 8 * gguf_bytes(path) / n_params, **llama_kld(path, base)})

    variants: dict[str, Path] = {}
    for spec in [s for s in args.mixbit.split(",") if s]:
        path, _ = build_variant(spec, resolved, cache_dir, work)
        variants[spec] = Path(path)
        lm = load(resolved, path=path, dequantize=True)
        add({"name": spec, "framework": "mixbit", "imatrix": False,
             "bpw": 8 * mlx_bytes(Path(path)) / n_params, **kld(base, logits_of(lm)).row()})
        del lm

    for spec in [s for s in args.export.split(",") if s]:
        if spec not in variants:
            variants[spec] = Path(build_variant(spec, resolved, cache_dir, work)[0])
        types = work / f"types-{spec}.txt"
        types.write_text("\n".join(tensor_types(variants[spec], mtp=False)) + "\n")
        for use in (False, True):
            path = quantize(bf16, "Q4_K_M", work / f"export-{spec}{'-imat' if use else ''}.gguf",
                            imatrix if use else None, types)
            add({"name": f"{spec} as GGUF" + (" +imatrix" if use else ""), "framework": "llama.cpp",
                 "imatrix": use, "export": True, "bpw": 8 * gguf_bytes(path) / n_params, **llama_kld(path, base)})

    print(table(rows, base))
    Path(args.out).write_text(json.dumps({"model": args.model, "chunks": base.n_chunk, "ctx": base.n_ctx,
                                          "scored_tokens": base.n_chunk * base.rows_per_chunk,
                                          "params": n_params, "rows": rows}, indent=1) + "\n")
    plot(rows, Path(args.plot))
    print(f"wrote {args.out} and {args.plot} ({time.time() - started:.0f} s)")
    return 0


def table(rows: list[dict], base) -> str:
    head = ["variant", "framework", "bpw", "KLD mean", "KLD p99", "top-1", "PPL"]
    lines = [f"{base.n_chunk} held-out chunks x {base.n_ctx} tokens, {base.n_chunk * base.rows_per_chunk} scored; "
             f"KLD against mixbit's bf16 (llama-perplexity's arithmetic)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: r["bpw"]):
        lines.append(f"| {r['name']} | {r['framework']} | {r['bpw']:.3f} | {r['kld_mean']:.5f} | "
                     f"{r['kld_p99']:.4f} | {r['top1']:.4f} | {r['ppl']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {
        "llama.cpp": ([r for r in rows if r["framework"] == "llama.cpp" and not r["imatrix"]
                       and not r.get("export") and r["bpw"] < 15], "o", "tab:blue"),
        "llama.cpp + imatrix": ([r for r in rows if r["framework"] == "llama.cpp" and r["imatrix"]
                                 and not r.get("export")], "s", "tab:cyan"),
        "mixbit's allocation in llama.cpp + imatrix": ([r for r in rows if r.get("export") and r["imatrix"]],
                                                       "D", "tab:green"),
        "mixbit (MLX)": ([r for r in rows if r["framework"] == "mixbit"], "^", "tab:red"),
    }
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (rs, marker, color) in groups.items():
        rs = sorted(rs, key=lambda r: r["bpw"])
        if not rs:
            continue
        ax.scatter([r["bpw"] for r in rs], [r["kld_mean"] for r in rs], marker=marker, color=color, label=label)
        for r in rs:
            ax.annotate(r["name"].replace(" +imatrix", "").replace(" as GGUF", ""), (r["bpw"], r["kld_mean"]),
                        textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
    ax.set_xlabel("bits per weight (stored bytes x 8 / parameters)")
    ax.set_ylabel("mean KLD vs bf16 (nats/token, held-out)")
    ax.set_yscale("log")
    ax.set_title("embedded Qwen3.5: mixbit against llama.cpp quantization, same tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
