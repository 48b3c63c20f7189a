"""The CPU plan: which op runs each projection of a served model, for decode rows and for prompts.

One object, made once per machine and variant and kept on disk (`cached_plan`), so that two
starts of one variant compute the same logits: what a layer computes is decided by the plan it
was built from (models/forward/layers.py) and the arguments of its call, never by timing at the
moment or by who calls it. Three ways to make one:

- `measure_plan` (generation.cpu_quantized "auto"): each layer shape timed here - the packed
  kernel (float32 or 16-bit activations) against dense float32 for decode rows, the prompt paths
  (BLAS, AMX tiles, PANEL, PANEL8) for a prefill chunk, and the row count from which a prompt
  path wins;
- `rule_plan` ("packed"): every supported layer packed, its modes from `cpu_activations` alone;
- a plan read back from its JSON file (`cached_plan`: the measured one of an earlier start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import kernels
from ..kernels import (BLAS, DENSE_CHECK_ROWS, FLOAT, INT16, PANEL, PANEL8, PROMPT_PATHS, SMALL, TILES,
                       decode_kind, measure, panel_support, shape_key, tiles_support)

log = logging.getLogger("mixbit.models")

PLAN_VERSION = 1  # bump when what a plan means changes (a cached plan of another version is measured anew)
RULE_PROMPT_ROWS = 16  # rule plans: rows from which a call takes the prompt path
MODES = {"float32": FLOAT, "int16": INT16}
PROMPT_MODES = {"blas": BLAS, "tiles": TILES, "panel": PANEL, "panel8": PANEL8}


@dataclass(frozen=True)
class ShapePlan:
    """How the projections of one shape (out, in, bits, group) run."""
    out: int
    inp: int
    bits: int
    group: int
    runs: str  # "packed" (mixbit's kernels on the stored bytes) or "dense" (float32 in MLX's graph)
    decode: str = "float32"  # decode rows: "float32" (FLOAT) or "int16" (INT16)
    prompt: str | None = None  # from prompt_from_rows rows: blas, tiles, panel, panel8; None: MLX dense
    prompt_from_rows: int = RULE_PROMPT_ROWS
    kernel_ms_1row: float | None = None  # measured plans only
    dense_ms_1row: float | None = None

    @property
    def key(self) -> tuple:
        return (self.out, self.inp, self.bits, self.group)

    @property
    def decode_mode(self) -> int:
        return MODES[self.decode]

    @property
    def prompt_mode(self) -> int | None:
        return PROMPT_MODES.get(self.prompt)


@dataclass
class CpuPlan:
    mode: str  # generation.cpu_quantized it was made for
    activations: str  # generation.cpu_activations it was made for
    shapes: dict = field(default_factory=dict)  # shape key -> ShapePlan
    small: int = SMALL  # projections under this many weights stay dense inside MLX's graph
    dense_bytes: int = 0
    source: str = "rules"  # "rules", "measured", or "cached" (read back)
    machine: dict = field(default_factory=dict)

    def for_shape(self, key: tuple) -> ShapePlan | None:
        return self.shapes.get(tuple(key))

    @property
    def packed_any(self) -> bool:
        return any(s.runs == "packed" for s in self.shapes.values())

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "mode": self.mode, "activations": self.activations,
                "small": self.small, "dense_bytes": self.dense_bytes, "machine": self.machine,
                "shapes": [asdict(s) for s in sorted(self.shapes.values(), key=lambda s: s.key)]}

    @classmethod
    def from_json(cls, data: dict, source: str = "cached") -> "CpuPlan":
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r}, this mixbit reads {PLAN_VERSION}")
        shapes = [ShapePlan(**s) for s in data["shapes"]]
        return cls(mode=data["mode"], activations=data["activations"], small=data["small"],
                   dense_bytes=data["dense_bytes"], machine=data.get("machine", {}), source=source,
                   shapes={s.key: s for s in shapes})

    def summary(self, counts: dict | None = None) -> dict:
        """For the log and /v1/models: how many projections run each way, and every shape."""
        counts = counts or {}
        return {"source": self.source, "mode": self.mode, "activations": self.activations,
                "machine": self.machine,  # the kernels' instruction-set path ("isa") among it
                "packed": counts.get("packed", 0), "dense": counts.get("dense", 0),
                "dense_bytes": self.dense_bytes,
                "shapes": [{"out": s.out, "in": s.inp, "bits": s.bits, "group": s.group, "runs": s.runs,
                            "decode": s.decode, "prefill_from_rows": s.prompt_from_rows if s.runs == "packed"
                            else None, "prefill": s.prompt if s.runs == "packed" else None,
                            "kernel_ms_1row": s.kernel_ms_1row, "dense_ms_1row": s.dense_ms_1row}
                           for s in sorted(self.shapes.values(), key=lambda s: s.key)]}


def candidates(model, small: int = SMALL):
    """(path, module, kind) for every projection the kernels can run: MLX's quantized (affine,
    with biases) and bfloat16 Linear/Embedding layers of at least `small` weights."""
    import mlx.core as mx
    import mlx.nn as nn

    for path, module in model.named_modules():
        kind = type(module)
        if kind in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            k = module["weight"].shape[1] * 32 // module.bits
            if module["weight"].shape[0] * k < small:
                continue
            if kernels.supports(module.bits, module.group_size, k, getattr(module, "mode", "affine")) \
                    and module.get("biases") is not None:
                yield path, module, "quantized"
        elif kind in (nn.Linear, nn.Embedding) and module.weight.dtype == mx.bfloat16 \
                and module.weight.shape[-1] % 64 == 0 and module.weight.size >= max(small, 1):
            yield path, module, "bfloat16"


def machine() -> dict:
    """What a measured plan depends on besides the variant: the CPU, its instruction sets as the
    kernels see them, and the threads they run on."""
    model_name = ""
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    info = kernels.info()
    return {"cpu": model_name or platform.processor() or platform.machine(), "isa": info.get("isa"),
            "vnni": bool(info.get("vnni")), "tiles": bool(info.get("tiles")), "threads": kernels.threads(),
            "blas": kernels.blas_available()}


def rule_plan(model, activations: str = "auto", small: int = SMALL) -> CpuPlan:
    """Every supported projection packed, with modes from `activations` alone (no timing):
    decode rows on INT16 where it runs and `activations` is int16/int8, else FLOAT; prompts of
    RULE_PROMPT_ROWS rows and more on PANEL8 (int8), PANEL (int16), else the AMX tiles where the
    CPU has them, else BLAS ("auto" counts as float32 here: the exact float paths)."""
    _check_activations(activations)
    shapes = {}
    for _, module, _ in candidates(model, small):
        n, k, bits, group = key = shape_key(module)
        if key in shapes:
            continue
        decode = "int16" if activations in ("int16", "int8") and kernels.int16_support(k, bits, group) \
            else "float32"
        if activations == "int8" and panel_support(n, k, bits, group):
            prompt = "panel8"
        elif activations == "int16" and panel_support(n, k, bits, group):
            prompt = "panel"
        elif tiles_support(n, k, bits, group):
            prompt = "tiles"
        else:
            prompt = "blas" if kernels.blas_available() else None
        shapes[key] = ShapePlan(n, k, bits, group, "packed", decode, prompt, RULE_PROMPT_ROWS)
    return CpuPlan(mode="packed", activations=activations, shapes=shapes, small=small, source="rules",
                   machine=machine())


def measure_plan(model, mode: str = "auto", activations: str = "auto", dense_budget: int = 0,
                 small: int = SMALL) -> CpuPlan:
    """Times each layer shape here (`kernels.measure`) and plans: a layer stays packed on the
    kernels unless dense float32 measured faster for one decode row (by a margin) and for a batch
    of DENSE_CHECK_ROWS right after a kernel call, and its dense weight fits `dense_budget` bytes
    over all such layers (largest gain first; "packed" mode: never dense). A packed layer takes
    the prompt path that measured fastest for a prefill chunk, from the smallest row count where
    it beat the decode kernel."""
    import mlx.core as mx

    _check_activations(activations)
    cands = list(candidates(model, small))
    timings = {}
    for _, module, _ in cands:
        key = shape_key(module)
        if key not in timings:
            mx.eval(module.parameters())
            timings[key] = measure(module, activations=activations)

    def prefer_dense(t):
        several = dict(t.get(DENSE_CHECK_ROWS, {}))  # against the faster packed path at those rows
        dense_several = several.pop("dense", 0.0)
        return t[1]["dense"] * 1.25 < t[1][decode_kind(t)] and dense_several < min(several.values(), default=1.0)

    budget = dense_budget if mode == "auto" else 0
    per_key_bytes: dict = {}
    for _, module, _ in cands:
        key = shape_key(module)
        per_key_bytes[key] = per_key_bytes.get(key, 0) + key[0] * key[1] * 4
    gains = sorted(((t[1][decode_kind(t)] - t[1]["dense"], key) for key, t in timings.items()
                    if prefer_dense(t)), reverse=True)
    dense_keys, spent = set(), 0
    for _, key in gains:
        if spent + per_key_bytes[key] <= budget:
            dense_keys.add(key)
            spent += per_key_bytes[key]
    shapes = {}
    for key, t in timings.items():
        dec = decode_kind(t)
        common = dict(decode="int16" if dec == "int16" else "float32",
                      kernel_ms_1row=round(t[1][dec] * 1e3, 3), dense_ms_1row=round(t[1]["dense"] * 1e3, 3))
        if key in dense_keys:
            shapes[key] = ShapePlan(*key, runs="dense", prompt=None, prompt_from_rows=0, **common)
            continue
        # the kernel's cost grows with every row, a prompt path's far more slowly: the faster
        # prompt path at a prefill chunk's rows, from the smallest measured row count where it won
        rows_t = {m: v for m, v in t.items() if m != "prompt"}
        paths = t.get("prompt") or {p: 0.0 for p in rows_t[max(rows_t)] if p in PROMPT_PATHS}
        best = min(paths, key=paths.get) if paths else None
        if activations == "int8" and "panel8" in paths:  # wherever it runs (PANEL was timed for batches)
            best = "panel8"
        # decode batches under PANEL8 run on PANEL (layers.py): its rows decide the crossover
        batch = "panel" if best == "panel8" else best
        wins = [m for m in sorted(rows_t) if m > 1 and rows_t[m].get(batch, float("inf")) < rows_t[m][dec]]
        shapes[key] = ShapePlan(*key, runs="packed", prompt=best,
                                prompt_from_rows=wins[0] if wins else 2 * max(rows_t), **common)
    mx.clear_cache()  # the measurements' dense copies go back to the system
    return CpuPlan(mode=mode, activations=activations, shapes=shapes, small=small, dense_bytes=spent,
                   source="measured", machine=machine())


def _check_activations(activations: str) -> None:
    if activations not in kernels.ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: allowed {', '.join(kernels.ACTIVATIONS)}")


def plan_path(plan_dir: Path, folder: Path, mode: str, activations: str, small: int) -> Path:
    """Where the measured plan of `folder` on this machine with these settings is kept: one file
    per variant, machine and settings under `plan_dir`."""
    folder = Path(folder).resolve()
    stamp = []
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        try:
            st = f.stat()
            stamp.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
        except OSError:
            pass
    key = json.dumps([str(folder), stamp, mode, activations, small, machine()], sort_keys=True)
    return Path(plan_dir) / f"{folder.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached_plan(model, folder: Path, plan_dir: Path | None, mode: str, activations: str,
                dense_budget: int, small: int = SMALL) -> CpuPlan:
    """The measured plan of `folder` on this machine, read from `plan_dir` when an earlier start
    measured it, measured and written there (atomically) otherwise; `plan_dir` None: measured,
    kept nowhere. A file that cannot be read or written is logged and measured around."""
    path = plan_path(plan_dir, folder, mode, activations, small) if plan_dir else None
    if path is not None and path.is_file():
        try:
            plan = CpuPlan.from_json(json.loads(path.read_text()), source="cached")
            log.info("CPU plan read from %s", path)
            return plan
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("CPU plan %s unreadable (%s): measuring it again", path, exc)
    plan = measure_plan(model, mode, activations, dense_budget, small)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(plan.to_json(), f, indent=1)
            os.replace(tmp, path)
            log.info("CPU plan measured and kept in %s", path)
        except OSError as exc:
            log.warning("CPU plan not kept (%s): the next start measures it again", exc)
    return plan
