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
from .artifact import weights_digest
from .formats import GATE_FORMAT_BITS, Format, is_gate, rows_and_width
from .progress import Progress, from_callback
from .recipes import DEFAULT_TARGET_BPW, RECIPES, static_plan

log = logging.getLogger("mixbit.quant")


@dataclass(frozen=True)
class Variant:
    path: Path  # folder mlx-lm loads
    recipe: str
    source: ResolvedModel
    manifest: dict  # provenance shown in /v1/models


EVALUATION_MODULES = {"compare.py", "evaluate.py", "report.py", "gguf_export.py", "llama_kld.py"}
AWQ_RECIPES = ("mixbit-auto", "unsloth-static")
# mixbit-auto's time for sensitivity: the exact ablation when it fits (the embedded model),
# else as many probes as fit (real sizes); see probe.py
DEFAULT_SENSITIVITY_SECONDS = 120.0
QUANTIZE_CACHE_BYTES = 256 << 20


def code_digest() -> str:
    """Changes whenever the quantizer's code changes, so old cache entries are not reused."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        if f.name in EVALUATION_MODULES:  # they read variants, never shape them
            continue
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def variant_key(source_digest: str, recipe: str, target_bpw: float | None, calibration: str) -> str:
    spec = {"source": source_digest, "recipe": recipe, "bpw": target_bpw, "calibration": calibration,
            "code": code_digest()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def ensure_variant(resolved: ResolvedModel, recipe: str = "bf16", cache_dir: str | None = None,
                   progress: Callable[[str], None] | Progress | None = None,
                   target_bpw: float | None = None, calibration: str | None = None,
                   sensitivity: str = "auto",
                   sensitivity_seconds: float = DEFAULT_SENSITIVITY_SECONDS,
                   memory_gb: float = 0.0) -> Variant:
    """`progress`: a Progress (stages, step k of n, ETA) or a plain `say(str)` callback."""
    prog = progress if isinstance(progress, Progress) else from_callback(progress or log.info)
    say = prog.say
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
    method = ""
    if recipe == "mixbit-auto" and sensitivity != "ablation":
        method = f"+{sensitivity}" + (f"@{sensitivity_seconds:g}s" if sensitivity in ("auto", "probe") else "")
    key = variant_key(weights_digest(resolved.path, root), recipe, target_bpw, calib_id + method)
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
    quantize(resolved, recipe, dst, target_bpw=target_bpw, calibration=calibration, progress=prog,
             sensitivity=sensitivity, sensitivity_seconds=sensitivity_seconds, cache_root=root,
             memory_gb=memory_gb)
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
             calibration: str | None = None, progress: Callable[[str], None] | Progress | None = None,
             cache_root: Path | None = None, sensitivity: str = "auto",
             sensitivity_seconds: float = DEFAULT_SENSITIVITY_SECONDS,
             plan: dict[str, Format] | None = None, memory_gb: float = 0.0) -> dict:
    """Builds the variant folder `dst` for `recipe` layer by layer (memory: one layer, a matrix
    of it made float32 at a time, whatever the checkpoint's size; planned and checked against
    `memory_gb` before any work, quant/memory.py); resumes a killed run of the same variant.
    `plan` replaces the recipe's formats (benchmarks build deliberately damaged variants with
    it). Returns the recipe.json content."""
    from mixbit.models.loading import load_tokenizer

    from . import calibration as calib
    from .stream import LayerStream
    from .writer import finalize, write_streamed

    prog = progress if isinstance(progress, Progress) else from_callback(progress or log.info)
    started = time.time()
    root = cache_root or dst.parent.parent
    digest = weights_digest(resolved.path, root)
    partial = dst.parent / f".{dst.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    # freed buffers go back to the system instead of MLX's cache: peak memory is the checkpoint
    # plus what one layer needs, not the sum of every size ever allocated
    cache_limit = mx.set_cache_limit(QUANTIZE_CACHE_BYTES)
    with _exclusive(partial, prog):
        stream = LayerStream(resolved.path)
        _note_extras(resolved.path)
        shapes = {p: list(m.weight.shape) for p, m in stream.all_tensors().items()}
        extra: dict = {}
        awq = recipe in AWQ_RECIPES and plan is None
        cal = None
        if recipe == "mixbit-auto" and plan is None or awq:
            prog.stage("calibration", 0, "chat, code and tool-calling text")
            cal = calib.for_quantization(resolved, calibration, root)
        heldout = calib.build(load_tokenizer(resolved.path)[0], n_rows=4, length=64, split="heldout")
        from . import memory
        from .probe import REF_BYTES

        mem = memory.plan(stream, cal.rows.size if cal is not None else 0, heldout.rows.size,
                          REF_BYTES if recipe == "mixbit-auto" and plan is None else 0, memory_gb,
                          stream.head_chunk_rows)
        prog.memory = mem.as_dict()
        prog.say(mem.line())
        memory.check(mem)
        if plan is not None:
            formats = dict(plan)
        elif recipe == "mixbit-auto":
            formats, extra = _auto_plan(stream, cal, root, digest, target_bpw or DEFAULT_TARGET_BPW,
                                        prog, sensitivity, sensitivity_seconds, shapes, partial)
        else:
            formats = with_gates(static_plan(recipe, shapes).formats, shapes)
        say = prog.say
        say(f"recipe {recipe}: quantizing {sum(f.bits != 16 for f in formats.values())} of "
            f"{len(formats)} tensors")
        manifest = _manifest(resolved, recipe, formats, shapes, target_bpw)
        manifest["source"]["weights_sha256"] = digest
        for path, info in extra.pop("tensors", {}).items():
            manifest["tensors"][path].update(info)
        manifest.update(extra)
        # the quantize-time check: small, float32, dequantized (`mixbit eval --variants`
        # measures fidelity on more data)
        shutil.rmtree(partial / "layer-inputs", ignore_errors=True)  # a killed run's probe inputs
        result = write_streamed(stream, partial, formats, dst.name, cal_rows=cal.rows if awq else None,
                                heldout_rows=heldout.rows, awq=awq, progress=prog)
        manifest["measured_kld"] = result.measured_kld
        manifest["measured_top1"] = result.measured_top1
        if awq:
            _record_awq(manifest, result.awq, stream.prefix)
        if result.mtp:
            manifest["mtp"] = {"kept": True, "tensors": result.mtp,
                               "note": "the MTP head (its linears at quant/writer.MTP_FORMAT, chosen by "
                                       "measuring acceptance); mlx-lm drops it on load, mixbit drafts with it"}
        prog.stage("finishing", 0, "checksums and rename")
        manifest["seconds"] = round(time.time() - started, 1)
        manifest["stages_s"] = dict(prog.stage_seconds)
        manifest["stages_peak_rss_gb"] = dict(prog.peak_rss_gb)
        manifest["stages_peak_anon_gb"] = dict(prog.peak_anon_gb)
        manifest["memory_plan"] = dict(prog.memory)
        finalize(stream, partial, dst, formats, manifest)
    mx.set_cache_limit(cache_limit)
    prog.finish()
    log.info("recipe %s: wrote %s (%.2f bits per weight, measured KLD %.4f) in %.1fs", recipe, dst,
             manifest["bits_per_weight"], manifest.get("measured_kld", float("nan")), manifest["seconds"])
    return manifest


class _exclusive:
    """One process builds a variant at a time (replicas sharing a cache wait for the first)."""

    def __init__(self, folder: Path, prog: Progress):
        self.path, self.prog = folder.parent / f"{folder.name}.lock", prog

    def __enter__(self):
        import fcntl

        self.fh = open(self.path, "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.prog.say("another process is building this variant; waiting for it")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()  # the (empty) lock file stays: unlinking it would race a waiter


def _note_extras(folder: Path) -> None:
    """One log line about what published checkpoints carry beside the text model."""
    import json as _json

    try:
        index = _json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return
    visual = sum(1 for k in index if k.startswith(("model.visual.", "vision_tower.")))
    if visual:
        log.info("the vision tower (%d tensors) is not part of the variant: mixbit serves text", visual)


def with_gates(formats: dict[str, Format], shapes: dict[str, list[int]]) -> dict[str, Format]:
    """MoE routers and shared-expert gates at >= 8 bits whatever the recipe says."""
    out = dict(formats)
    for path, shape in shapes.items():
        if is_gate(path) and (out.get(path) is None or out[path].bits < GATE_FORMAT_BITS):
            g = 64 if shape[-1] % 64 == 0 else 32
            out[path] = Format(GATE_FORMAT_BITS, g)
    return out


def _record_awq(manifest: dict, groups: list, prefix: str) -> None:
    for layer, _norm, members, alpha, _before, _after in groups:
        for member in members:
            path = f"{prefix}.layers.{layer}.{member}"
            if path in manifest["tensors"]:
                manifest["tensors"][path]["awq"] = alpha > 0
                manifest["tensors"][path]["awq_alpha"] = alpha
    before = sum(g[4] for g in groups)
    manifest["awq"] = {"groups": len(groups), "scaled": sum(g[3] > 0 for g in groups),
                       "error_reduction": round(1 - sum(g[5] for g in groups) / max(before, 1e-12), 4)}


def choose_method(choice: str, n_tensors: int, n_bits: int, fp, budget_s: float, n_layers: int) -> str:
    """auto: the exact ablation when every (tensor, bits) probe fits the time budget, else
    probes (as many as fit). A probe costs about half a forward pass on the probe rows."""
    if choice != "auto":
        return choice
    per_layer = sum(fp.layer_seconds) / max(n_layers, 1) * fp.probe_rows.shape[0] / fp.rows_total
    mean_probe = per_layer * n_layers / 2 + fp.head_seconds
    return "ablation" if mean_probe * n_tensors * n_bits <= budget_s else "probe"


def _auto_plan(stream, cal, root: Path, digest: str, target_bpw: float, prog: Progress,
               sensitivity: str, budget_s: float, shapes: dict, partial: Path) -> tuple[dict, dict]:
    """Measure (or reuse the saved table), then allocate bits under the budget."""
    from .allocate import allocate, budget_for_bpw
    from .formats import BITS
    from .probe import estimate, first_pass
    from .sensitivity import SensitivityTable

    # keyed by the weights, the calibration and the quantizer's code (an improved estimator
    # must not reuse an older table)
    prefix = root / "sensitivity" / f"{digest[:20]}-{cal.digest[:16]}-{code_digest()[:8]}"
    saved = {"ablation": Path(f"{prefix}.json"), "fisher": Path(f"{prefix}-fisher.json"),
             "probe": Path(f"{prefix}-probe@{budget_s:g}s.json")}  # probes depend on the budget
    wanted = [sensitivity] if sensitivity != "auto" else ["ablation", "probe"]
    found = next((saved[m] for m in wanted if saved[m].is_file()), None)
    if found is not None:
        table = SensitivityTable.from_json(json.loads(found.read_text()))
        prog.say(f"sensitivity table reused: {found}")
        method, table_path = table.meta.get("method", "ablation"), found
    elif sensitivity == "fisher":
        table, method, table_path = _fisher(stream, cal, prog), "fisher", saved["fisher"]
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table.save(table_path)
    else:
        spill = partial / "layer-inputs"  # the probes' inputs on disk: memory flat in depth
        shutil.rmtree(spill, ignore_errors=True)
        spill.mkdir()
        fp = first_pass(stream, cal.rows, prog, spill=spill)
        method = choose_method(sensitivity, len(shapes), len(BITS), fp, budget_s, len(stream.layers))
        table_path = saved[method]
        partial_path = table_path.with_suffix(".partial.json")
        try:
            saved = json.loads(partial_path.read_text())
            if saved.get("budget_s") != budget_s:
                saved = {}
        except (OSError, ValueError):
            saved = {}
        table_path.parent.mkdir(parents=True, exist_ok=True)
        last = [0.0]

        def keep(measured: dict) -> None:  # a killed run resumes with these
            if time.time() - last[0] < 2:
                return
            last[0] = time.time()
            tmp = partial_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**measured, "budget_s": budget_s}))
            tmp.replace(partial_path)

        table = estimate(stream, fp, budget_s, exact_all_bits=method == "ablation", progress=prog,
                         saved=saved, on_save=keep)
        table.meta["calibration"] = cal.provenance
        table.save(table_path)
        partial_path.unlink(missing_ok=True)
        del fp
        shutil.rmtree(spill, ignore_errors=True)
    prog.stage("allocation", 0, f"{target_bpw} bits per weight")
    fixed = {p: f for p, f in with_gates({}, shapes).items() if p in table.kld}
    alloc = allocate(table, budget_for_bpw(table, target_bpw), fixed=fixed)
    tensors = {p: {"sensitivity_kld": round(o.kld, 6), "sensitivity_q4g64": table.kld[p].get("q4g64")}
               for p, o in alloc.choice.items()}
    return alloc.formats(), {"tensors": tensors, "predicted_kld": alloc.predicted_kld,
                             "calibration": cal.provenance, "sensitivity_table": str(table_path),
                             "sensitivity_method": method,
                             "sensitivity_probes": table.meta.get("probes")}


def _fisher(stream, cal, prog: Progress):
    """The diagonal-Fisher estimate needs the whole model and its gradients in memory (about
    16 bytes per parameter): refused when that does not fit."""
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    from .sensitivity import fisher_estimate

    params = sum(m.weight.size for m in stream.all_tensors().values())
    need = 16 * params
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > 0.8 * avail:
        raise MemoryError(f"quant.sensitivity = fisher needs about {need / 1e9:.1f} GB for "
                          f"{params / 1e6:.0f}M parameters; {avail / 1e9:.1f} GB are free. Use "
                          "auto or probe (streamed, forward-only)")
    prog.stage("sensitivity", cal.rows.shape[0], "fisher")
    lm = load(resolve(str(stream.folder)), "auto", cpu_quantized="dense")  # plain MLX layers: gradients
    return fisher_estimate(lm.model, cal, progress=lambda k, n, _: prog.step(k, n))


def _manifest(resolved: ResolvedModel, recipe: str, formats: dict[str, Format],
              shapes: dict[str, list[int]], target_bpw: float | None) -> dict:
    tensors = {}
    total_bytes = 0.0
    total_params = 0
    for path, fmt in formats.items():
        n_out, n_in = rows_and_width(shapes[path])
        nbytes = fmt.nbytes(n_out, n_in)
        tensors[path] = {"bits": fmt.bits, "group_size": fmt.group_size, "format": fmt.name,
                         "bytes": int(nbytes), "awq": False}
        total_bytes += nbytes
        total_params += n_out * n_in
    return {"recipe": recipe, "target_bpw": target_bpw, "tensors": tensors,
            "bits_per_weight": 8 * total_bytes / max(total_params, 1), "bytes": int(total_bytes),
            "source": {"model": resolved.source, "weights_sha256": None},
            "code": code_digest()}
