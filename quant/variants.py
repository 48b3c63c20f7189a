"""`ensure_variant`: the one door between a model source and what the server loads.

Given a resolved checkpoint and a recipe it returns the folder to serve: the checkpoint itself
for "bf16" and for folders that are already MLX-quantized; otherwise a cached quantized variant
under `cache_dir/variants/<key>`, where the key hashes the source weights, the recipe and its
budget, the calibration data and the quantizer's own code. A cache hit is verified (checksums)
before it is served; a damaged or partial entry is reported in one log line and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mixbit.models.registry import ResolvedModel

from . import artifact
from .formats import Format, quantizable
from .recipes import DEFAULT_TARGET_BPW, RECIPES, static_plan

log = logging.getLogger("mixbit.quant")


@dataclass(frozen=True)
class Variant:
    path: Path  # folder mlx-lm loads
    recipe: str
    source: ResolvedModel
    manifest: dict  # provenance shown in /v1/models


EVALUATION_MODULES = {"compare.py", "evaluate.py", "report.py"}


def code_digest() -> str:
    """Changes whenever the quantizer's code changes, so old cache entries are not reused."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        if f.name in EVALUATION_MODULES:  # they read variants, never shape them
            continue
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def weights_digest(folder: Path, cache_root: Path) -> str:
    """sha256 of the weight files, remembered by (path, size, mtime) so big checkpoints are
    hashed once, not at every start."""
    memo_path = cache_root / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, json.JSONDecodeError):
        memo = {}
    files = sorted(folder.glob("*.safetensors"))
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    if stamp in memo:
        return memo[stamp]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(artifact.sha256_file(f).encode())
    memo[stamp] = h.hexdigest()
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:  # a read-only cache (replicas mounting what a Job quantized): just compute
        pass
    return memo[stamp]


def variant_key(source_digest: str, recipe: str, target_bpw: float | None, calibration: str) -> str:
    spec = {"source": source_digest, "recipe": recipe, "bpw": target_bpw, "calibration": calibration,
            "code": code_digest()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _shapes(folder: Path) -> dict[str, list[int]]:
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, lazy=True)
    return {p: list(m.weight.shape) for p, m in quantizable(model).items()}


def ensure_variant(resolved: ResolvedModel, recipe: str = "bf16", cache_dir: str | None = None,
                   progress: Callable[[str], None] | None = None, target_bpw: float | None = None,
                   calibration: str | None = None, sensitivity: str = "auto") -> Variant:
    say = progress or (lambda msg: log.info(msg))
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; available: {', '.join(RECIPES)}")
    if resolved.quantized:
        # a community MLX quant or a `mixbit quantize --out` folder: served unchanged
        manifest = _read_recipe(resolved.path) or {"recipe": "as-is (already quantized)"}
        manifest = {**manifest, "source": resolved.source}
        return Variant(path=resolved.path, recipe=manifest.get("recipe", "as-is"), source=resolved,
                       manifest=manifest)
    if recipe == "bf16":
        say(f"recipe bf16: serving {resolved.path} unquantized")
        return Variant(path=resolved.path, recipe=recipe, source=resolved,
                       manifest={"recipe": "bf16", "source": resolved.source, "bits_per_weight": 16.0})
    root = Path(cache_dir or "~/.cache/mixbit").expanduser()
    variants = root / "variants"
    artifact.clean_partials(variants)
    if recipe == "mixbit-auto" and target_bpw is None:
        target_bpw = DEFAULT_TARGET_BPW
    calib_id = "builtin" if not calibration else "self" if calibration == "self" else \
        artifact.sha256_file(Path(calibration))[:16]
    method = sensitivity_method(resolved, sensitivity) if recipe == "mixbit-auto" else None
    key = variant_key(weights_digest(resolved.path, root), recipe, target_bpw,
                      calib_id + (f"+{method}" if method and method != "ablation" else ""))
    dst = variants / key
    if dst.exists():
        started = time.time()
        problem = artifact.verify(dst)
        if problem is None:
            say(f"cached variant {recipe} verified in {time.time() - started:.1f}s: {dst}")
            return Variant(path=dst, recipe=recipe, source=resolved,
                           manifest={**(_read_recipe(dst) or {}), "source": resolved.source})
        log.warning("cached variant %s is damaged (%s); rebuilding it", dst, problem)
        shutil.rmtree(dst, ignore_errors=True)
    quantize(resolved, recipe, dst, target_bpw=target_bpw, calibration=calibration, progress=say,
             sensitivity=sensitivity,
             cache_root=root)
    return Variant(path=dst, recipe=recipe, source=resolved,
                   manifest={**(_read_recipe(dst) or {}), "source": resolved.source})


def _read_recipe(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / artifact.RECIPE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return {k: data[k] for k in ("recipe", "bits_per_weight", "bytes", "predicted_kld", "measured_kld",
                                 "measured_top1", "target_bpw", "calibration") if k in data}


def quantize(resolved: ResolvedModel, recipe: str, dst: Path, target_bpw: float | None = None,
             calibration: str | None = None, progress: Callable[[str], None] | None = None,
             cache_root: Path | None = None, sensitivity: str = "auto") -> dict:
    """Builds the variant folder `dst` for `recipe`; returns its recipe.json content."""
    say = progress or (lambda msg: log.info(msg))
    started = time.time()
    root = cache_root or dst.parent.parent
    digest = weights_digest(resolved.path, root)
    shapes = _shapes(resolved.path)
    extra: dict = {}
    if recipe == "mixbit-auto":
        formats, extra = _auto_plan(resolved, root, digest, target_bpw or DEFAULT_TARGET_BPW,
                                    calibration, say, sensitivity_method(resolved, sensitivity))
    else:
        formats = static_plan(recipe, shapes).formats
    say(f"recipe {recipe}: quantizing {len(formats)} tensors")
    manifest = _manifest(resolved, recipe, formats, shapes, target_bpw)
    manifest["source"]["weights_sha256"] = digest
    for path, info in extra.pop("tensors", {}).items():
        manifest["tensors"][path].update(info)
    manifest.update(extra)
    transform = _awq_transform(resolved, formats, manifest, calibration, say, root) \
        if recipe in AWQ_RECIPES else None
    from mlx_lm.utils import load_tokenizer

    from . import calibration as calib

    # small: it runs in the checkpoint's own dtype (bf16 is slow on CPU); `mixbit eval --variants`
    # measures fidelity on more data in float32
    heldout = calib.build(load_tokenizer(resolved.path), n_rows=4, length=64, split="heldout")
    artifact.write_variant(resolved.path, dst, formats, manifest, transform=transform,
                           fidelity_rows=heldout.rows)
    manifest["seconds"] = round(time.time() - started, 1)
    say(f"recipe {recipe}: wrote {dst} ({manifest['bits_per_weight']:.2f} bits per weight, measured "
        f"KLD {manifest.get('measured_kld', float('nan')):.4f}) in {manifest['seconds']}s")
    return manifest


AWQ_RECIPES = ("mixbit-auto", "unsloth-static")


def _awq_transform(resolved: ResolvedModel, formats: dict[str, Format], manifest: dict,
                   calibration: str | None, say: Callable[[str], None], root: Path) -> Callable:
    """AWQ scales searched on calibration activations and folded into the norms, recorded in
    the manifest (alpha per group, and which tensors were scaled)."""
    from . import calibration as calib
    from .awq import apply_awq

    def transform(model) -> None:
        say("AWQ: searching activation-aware scales")
        cal = calib.for_quantization(resolved, calibration, root)
        groups = apply_awq(model, cal.rows, formats)
        prefix = next(iter(formats)).split(".layers.")[0] if formats else ""
        for g in groups:
            for member in g.members:
                path = f"{prefix}.layers.{g.layer}.{member}"
                if path in manifest["tensors"]:
                    manifest["tensors"][path]["awq"] = g.alpha > 0
                    manifest["tensors"][path]["awq_alpha"] = g.alpha
        manifest["awq"] = {"groups": len(groups), "scaled": sum(g.alpha > 0 for g in groups),
                           "error_reduction": round(1 - sum(g.error_after for g in groups)
                                                    / max(sum(g.error_before for g in groups), 1e-12), 4)}

    return transform


ABLATION_LIMIT = 400  # (tensor, bits) pairs; above it "auto" uses the Fisher estimate


def sensitivity_method(resolved: ResolvedModel, choice: str = "auto") -> str:
    """ablation or fisher: ablation costs a forward pass per (tensor, bit width)."""
    if choice != "auto":
        return choice
    from .formats import BITS

    return "ablation" if len(_shapes(resolved.path)) * len(BITS) <= ABLATION_LIMIT else "fisher"


def _auto_plan(resolved: ResolvedModel, root: Path, digest: str, target_bpw: float,
               calibration: str | None, say: Callable[[str], None],
               method: str = "ablation") -> tuple[dict, dict]:
    """Measure (or reuse the saved table), then allocate bits under the budget."""
    from mixbit.models.loading import load

    from . import calibration as calib
    from .allocate import allocate, budget_for_bpw
    from .sensitivity import SensitivityTable, fisher_estimate, measure

    lm = load(resolved, "auto")
    cal = calib.for_quantization(resolved, calibration, root)
    suffix = "" if method == "ablation" else f"-{method}"
    table_path = root / "sensitivity" / f"{digest[:20]}-{cal.digest[:16]}{suffix}.json"
    if table_path.is_file():
        table = SensitivityTable.from_json(json.loads(table_path.read_text()))
        say(f"sensitivity table reused: {table_path}")
    else:
        last = [0.0]

        def tick(done: int, total: int, path: str) -> None:
            if time.time() - last[0] > 2 or done == total:
                last[0] = time.time()
                say(f"measuring sensitivity {done}/{total}: {path}")

        say(f"sensitivity by {method}")
        table = measure(lm.model, cal, progress=tick) if method == "ablation" else \
            fisher_estimate(lm.model, cal, progress=tick)
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table.save(table_path)
    alloc = allocate(table, budget_for_bpw(table, target_bpw))
    tensors = {p: {"sensitivity_kld": round(o.kld, 6), "sensitivity_q4g64": table.kld[p].get("q4g64")}
               for p, o in alloc.choice.items()}
    return alloc.formats(), {"tensors": tensors, "predicted_kld": alloc.predicted_kld,
                             "calibration": cal.provenance, "sensitivity_table": str(table_path),
                             "sensitivity_method": method}


def _manifest(resolved: ResolvedModel, recipe: str, formats: dict[str, Format],
              shapes: dict[str, list[int]], target_bpw: float | None) -> dict:
    tensors = {}
    total_bytes = 0.0
    total_params = 0
    for path, fmt in formats.items():
        n_out, n_in = shapes[path][0], shapes[path][-1]
        nbytes = fmt.nbytes(n_out, n_in)
        tensors[path] = {"bits": fmt.bits, "group_size": fmt.group_size, "format": fmt.name,
                         "bytes": int(nbytes), "awq": False}
        total_bytes += nbytes
        total_params += n_out * n_in
    return {"recipe": recipe, "target_bpw": target_bpw, "tensors": tensors,
            "bits_per_weight": 8 * total_bytes / max(total_params, 1), "bytes": int(total_bytes),
            "source": {"model": resolved.source, "weights_sha256": None},
            "code": code_digest()}
