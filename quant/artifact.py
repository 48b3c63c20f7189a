"""The quantized artifact: a standard MLX checkpoint (per-layer "quantization" entries in
config.json, loadable by stock `mlx_lm.load`) plus `recipe.json` (why every tensor got its bits)
and `checksums.json` (sha256 of every file).

Written to a hidden temporary folder beside the destination, every file fsynced, then renamed
into place in one step: a killed run leaves only a temporary folder, which is never served and is
removed by the next run. `verify` recomputes the checksums; a damaged entry is reported in one log
line and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from .formats import Format

log = logging.getLogger("mixbit.quant")
CHECKSUMS = "checksums.json"
RECIPE = "recipe.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quant_predicate(plan: dict[str, Format]) -> Callable:
    """For mlx-lm's quantize_model: False keeps a tensor in bf16, a dict sets its format."""
    def predicate(path: str, module) -> bool | dict:
        fmt = plan.get(path)
        if fmt is None or fmt.bits == 16:
            return False
        return {"group_size": fmt.group_size, "bits": fmt.bits, "mode": "affine"}
    return predicate


def _logprobs(model, rows):
    import mlx.core as mx

    out = []
    for i in range(rows.shape[0]):
        lg = model(rows[i:i + 1]).astype(mx.float32)
        out.append(lg - mx.logsumexp(lg, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return out


def write_variant(src: Path, dst: Path, plan: dict[str, Format], recipe: dict,
                  transform: Callable | None = None, fidelity_rows=None) -> Path:
    """Quantizes the checkpoint in `src` by `plan` into `dst` (atomically). With
    `fidelity_rows` (held-out token rows), the measured KLD against the unquantized model is
    recorded in recipe.json as `measured_kld`."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer, quantize_model, save

    model, config = load_model(src)  # stored dtypes: bf16 weights, float32 A_log
    reference = _logprobs(model, fidelity_rows) if fidelity_rows is not None else None
    if transform is not None:
        transform(model)  # e.g. AWQ scales folded into norms, before quantizing
    default = next((f for f in plan.values() if f.bits != 16), Format(4, 64))
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["quantization"] = {"group_size": default.group_size, "bits": default.bits, "mode": "affine"}
    model, config = quantize_model(model, config, default.group_size, default.bits,
                                   quant_predicate=quant_predicate(plan))
    # quantize_model records only dict answers; state bf16 tensors explicitly for readers
    for path, fmt in plan.items():
        if fmt.bits == 16:
            config["quantization"][path] = False
    config["quantization_config"] = config["quantization"]
    if reference is not None:
        got = _logprobs(model, fidelity_rows)
        klds = mx.concatenate([(mx.exp(r) * (r - g)).sum(axis=-1).reshape(-1) for r, g in zip(reference, got)])
        top1 = mx.concatenate([(r.argmax(-1) == g.argmax(-1)).reshape(-1) for r, g in zip(reference, got)])
        recipe["measured_kld"] = float(klds.mean().item())
        recipe["measured_top1"] = float(top1.astype(mx.float32).mean().item())
    tokenizer = load_tokenizer(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp, src, model, tokenizer, config, donate_model=True)
    (tmp / RECIPE).write_text(json.dumps(recipe, indent=1, sort_keys=True) + "\n")
    sums = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
    _fsync_tree(tmp)
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dst


def verify(folder: Path) -> str | None:
    """None when the folder is intact; otherwise what is wrong, in a few words."""
    sums_path = folder / CHECKSUMS
    if not sums_path.is_file():
        return "no checksums.json"
    try:
        sums = json.loads(sums_path.read_text())
    except json.JSONDecodeError:
        return "checksums.json is damaged"
    for name, digest in sums.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if sha256_file(f) != digest:
            return f"{name} does not match its checksum"
    return None


def clean_partials(root: Path) -> None:
    """Removes temporary folders left by killed runs (never served: their names start with '.')."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        marker = ".tmp-" if ".tmp-" in p.name else ".old-" if ".old-" in p.name else None
        if not (p.name.startswith(".") and marker and p.is_dir()):
            continue
        pid = p.name.rsplit(marker, 1)[1]
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue  # another process is writing it right now
        shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
