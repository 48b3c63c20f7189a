"""`mixbit eval --variants ...`: quantized variants side by side against bf16, as a table and a
PNG plot of KLD against size with the Pareto front.

A variant is a recipe name (`uniform-4`, `uniform-3`, `unsloth-static`, `mixbit-auto`,
`mixbit-auto@3.8` for another budget, `+self` for self-generated calibration, `~probe`,
`~ablation` or `~probe:10` for a sensitivity method and its time budget in seconds), one of
mlx-lm's own quantizers (`mlx-uniform-4`,
`mlx-uniform-3` from `mlx_lm.convert`; `mlx-dynamic@4.5` from `mlx_lm.quant.dynamic_quant`, fed
the same built-in calibration text), or a folder holding any MLX checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mixbit.models.training import corpus
from mixbit.models.forward import score
from mixbit.models.loading import LoadedModel, load
from mixbit.models.registry import ResolvedModel, resolve

from . import calibration as calib
from .evaluate import heldout_loss_by_kind, tool_call_eval
from .soak import MODES, soak_variant
from .variants import ensure_variant


@dataclass
class VariantResult:
    name: str
    path: str
    nbytes: int
    bits_per_weight: float
    kld_mean: float
    kld_p99: float
    top1: float
    ppl: dict[str, float] = field(default_factory=dict)
    tools: dict[str, float] = field(default_factory=dict)
    tools_constrained: dict[str, float] = field(default_factory=dict)
    soak: dict = field(default_factory=dict)  # agent soak through /v1/messages, per mode (soak.MODES)
    seconds_to_build: float = 0.0
    error: str = ""  # a variant that could not be built or loaded: reported, the others go on


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def bits_per_weight(nbytes: int, n_params: int) -> float:
    """Stored bits per weight (scales and biases included), from the checkpoint's bytes: the
    loaded model is float32 on CPU, so counting its arrays would say 32 for a bf16 checkpoint."""
    return 8 * nbytes / n_params


def parameter_count(lm: LoadedModel) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(lm.model.parameters()))


def build_variant(spec: str, resolved: ResolvedModel, cache_dir: str, work: Path) -> tuple[Path, float]:
    """Folder of the variant named by `spec` (built or reused), and seconds spent building it."""
    started = time.time()
    if Path(spec).is_dir():
        return Path(spec), 0.0
    if spec.startswith("mlx-uniform-"):
        bits = int(spec.rsplit("-", 1)[1])
        out = work / spec
        if not out.exists():
            from mlx_lm import convert

            convert(str(resolved.path), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
        return out, time.time() - started
    if spec.startswith("mlx-dynamic"):
        bpw = float(spec.split("@")[1]) if "@" in spec else 4.5
        out = work / f"mlx-dynamic-{bpw}"
        if not out.exists():
            _run_dynamic_quant(resolved, out, bpw, work)
        return out, time.time() - started
    spec, _, how = spec.partition("~")  # e.g. mixbit-auto@3.5~probe or ~probe:10 (budget, s)
    spec, _, calibration = spec.partition("+")  # e.g. mixbit-auto@4.5+self
    recipe, _, bpw = spec.partition("@")
    method, _, seconds = how.partition(":")
    variant = ensure_variant(resolved, recipe, cache_dir=cache_dir,
                             target_bpw=float(bpw) if bpw else None, calibration=calibration or None,
                             sensitivity=method or "auto",
                             **({"sensitivity_seconds": float(seconds)} if seconds else {}))
    return variant.path, time.time() - started


def _run_dynamic_quant(resolved: ResolvedModel, out: Path, bpw: float, work: Path) -> None:
    """mlx-lm's dynamic_quant downloads its own calibration text; give it ours instead, under a
    throwaway HOME (~/.cache/mlx-lm/calibration_v5.txt), so no network is needed."""
    from mixbit.models.loading import load_tokenizer

    home = work / "dynamic-home"
    target = home / ".cache" / "mlx-lm" / "calibration_v5.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(resolved.path)[0]
    docs = calib.builtin_documents(96)
    target.write_text("\n".join(calib.render(tok, d) for d in docs))
    env = dict(os.environ, HOME=str(home), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "mlx_lm.quant.dynamic_quant", "--model", str(resolved.path),
           "--mlx-path", str(out), "--target-bpw", str(bpw), "--low-bits", "3", "--high-bits", "5"]
    subprocess.run(cmd, env=env, cwd=work, check=True, capture_output=True)


def token_klds(reference: LoadedModel, candidate: LoadedModel, rows: mx.array) -> tuple[mx.array, float]:
    """Per-token KL(bf16 || candidate) and top-1 agreement on `rows`."""
    klds, agree, total = [], 0, 0
    for i in range(rows.shape[0]):
        x = rows[i:i + 1]
        ref = score(reference.model, x).astype(mx.float32)[0]
        got = score(candidate.model, x).astype(mx.float32)[0]
        ref_lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        got_lp = got - mx.logsumexp(got, axis=-1, keepdims=True)
        klds.append((mx.exp(ref_lp) * (ref_lp - got_lp)).sum(axis=-1))
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum().item())
        total += x.shape[1]
    return mx.concatenate(klds), agree / total


def compare(source: str, specs: list[str], cache_dir: str, n_tool: int = 48, n_docs: int = 120,
            work: Path | None = None, progress=print, on_result=None,
            soak: int = 0) -> list[VariantResult]:
    """`soak`: rounds of the agent soak through the served /v1/messages per variant (0: none)."""
    resolved = resolve(source)
    work = work or Path(tempfile.mkdtemp(prefix="mixbit-eval-"))
    reference = load(resolved)
    n_params = parameter_count(reference)
    rows = calib.build(reference.tokenizer, n_rows=16, length=256, split="heldout").rows
    docs = corpus.heldout_documents(n_docs)
    prompts = corpus.heldout_tool_prompts(n_tool) + corpus.heldout_plain_prompts(max(n_tool // 2, 1))
    results = []
    for spec in ["bf16"] + [s for s in specs if s != "bf16"]:
        progress(f"evaluating {spec}")
        if spec == "bf16":
            path, built, lm = resolved.path, 0.0, reference
        else:
            try:
                path, built = build_variant(spec, resolved, cache_dir, work)
                # measured on the dequantized weights: the same function to float rounding (KLD
                # 0.02349 vs 0.02328 for uniform-4 through the quantized kernels), at BLAS speed
                # on CPU, where prefilling through quantized kernels is the slow part
                lm = load(resolved, path=path, dequantize=True)
            except Exception as exc:  # noqa: BLE001 - e.g. a peer quantizer that refuses the model
                err = getattr(exc, "stderr", b"") or b""
                detail = (err.decode(errors="replace").strip().splitlines() or [str(exc)])[-1]
                progress(f"{spec}: failed: {detail}")
                results.append(VariantResult(name=spec, path="", nbytes=0, bits_per_weight=float("nan"),
                                             kld_mean=float("nan"), kld_p99=float("nan"),
                                             top1=float("nan"), error=detail[:300]))
                if on_result:
                    on_result(results)
                continue
        klds, top1 = token_klds(reference, lm, rows)
        sorted_k = mx.sort(klds)
        p99 = float(sorted_k[int(0.99 * (sorted_k.size - 1))].item())
        losses = heldout_loss_by_kind(lm, docs)
        tools = tool_call_eval(lm, prompts).rates()
        constrained = tool_call_eval(lm, prompts, constrained=True).rates()
        soaks = soak_variant(Path(path), work, spec, max_rounds=soak, progress=progress) if soak else {}
        nbytes = weight_bytes(Path(path))
        results.append(VariantResult(
            name=spec, path=str(path), nbytes=nbytes, bits_per_weight=bits_per_weight(nbytes, n_params),
            kld_mean=float(klds.mean().item()), kld_p99=p99, top1=top1,
            ppl={k: math.exp(v) for k, v in losses.items()}, tools=tools, tools_constrained=constrained,
            soak=soaks, seconds_to_build=round(built, 1)))
        if on_result:
            on_result(results)
    return results


def table(results: list[VariantResult]) -> str:
    kinds = sorted({k for r in results for k in r.ppl})
    head = ["variant", "MB", "bpw", "KLD mean", "KLD p99", "top-1", *[f"ppl {k}" for k in kinds],
            "call ok", "right fn", "exact args", "plain ok", "exact args (grammar)",
            "agent soak via /v1/messages: first broken round; broken/played (free / grammar)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"| {r.name} | failed: {r.error} |")
            continue
        cells = [r.name, f"{r.nbytes / 1e6:.2f}", f"{r.bits_per_weight:.2f}", f"{r.kld_mean:.4f}",
                 f"{r.kld_p99:.4f}", f"{r.top1:.3f}", *[f"{r.ppl.get(k, float('nan')):.3f}" for k in kinds],
                 f"{r.tools['well_formed']:.1%}", f"{r.tools['right_function']:.1%}",
                 f"{r.tools['exact_args']:.1%}", f"{r.tools['plain_answer']:.1%}",
                 f"{r.tools_constrained.get('exact_args', float('nan')):.1%}",
                 " / ".join(_rounds(r.soak.get(m)) for m in MODES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rounds(soak: dict | None) -> str:
    """'8 (no tool call); 5/31': first round that broke, why, rounds that broke of those played."""
    if not soak:
        return "-"
    if soak["broke_at"] is None:
        return f"none; 0/{soak['played']}" + (f" ({soak['reason']})" if soak["reason"] else "")
    return f"{soak['broke_at']} ({soak['reason']}); {soak['failed']}/{soak['played']}"


def pareto(results: list[VariantResult]) -> list[VariantResult]:
    front, best = [], float("inf")
    for r in sorted(results, key=lambda r: (r.nbytes, r.kld_mean)):
        if r.kld_mean < best:
            front.append(r)
            best = r.kld_mean
    return front


def plot(results: list[VariantResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quantized = [r for r in results if r.name != "bf16" and not r.error]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in quantized:
        ax.scatter(r.nbytes / 1e6, r.kld_mean, s=40)
        ax.annotate(r.name, (r.nbytes / 1e6, r.kld_mean), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto(quantized)
    ax.plot([r.nbytes / 1e6 for r in front], [r.kld_mean for r in front], "--", color="grey",
            label="Pareto front")
    ax.set_xlabel("weights (MB)")
    ax.set_ylabel("mean KLD vs bf16 (nats/token, held-out)")
    ax.set_yscale("log")
    ax.set_title("quantized variants: fidelity against size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(results: list[VariantResult]) -> list[dict]:
    return [r.__dict__ for r in results]


def main_eval(source: str, specs: list[str], cache_dir: str, out_json: str | None, out_png: str | None,
              n_tool: int, soak: int = 0, n_docs: int = 120) -> str:
    def save(partial):
        if out_json:  # whole or not at all: a cut run leaves the rows that finished
            tmp = Path(out_json).with_suffix(".json.tmp")
            tmp.write_text(json.dumps(to_json(partial), indent=1) + "\n")
            os.replace(tmp, out_json)

    results = compare(source, specs, cache_dir, n_tool=n_tool, n_docs=n_docs, on_result=save, soak=soak)
    text = table(results)
    save(results)
    if out_png:
        plot(results, Path(out_png))
    return text
