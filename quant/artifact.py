"""The quantized artifact: a standard MLX checkpoint (per-layer "quantization" entries in
config.json, loadable by stock `mlx_lm.load`) plus `recipe.json` (why every tensor got its bits)
and `checksums.json` (sha256 of every file).

Written (quant/writer.py) into a hidden partial folder beside the destination, layer by layer,
then every file fsynced and the folder renamed into place in one step: a killed run leaves only
the partial folder, which is never served; the next run of the same variant resumes it (older
partials and temporary folders of dead processes are removed). `verify` recomputes the
checksums; a damaged entry is reported in one log line and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("mixbit.quant")
CHECKSUMS = "checksums.json"
STALE_PARTIAL_S = 7 * 86400
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


def publish(tmp: Path, dst: Path, recipe: dict) -> Path:
    """Adds recipe.json and checksums.json to a complete folder, fsyncs it, and renames it to
    `dst` in one step (replacing an older entry)."""
    (tmp / RECIPE).write_text(json.dumps(recipe, indent=1, sort_keys=True) + "\n")
    sums = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file() and f.name != CHECKSUMS}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
    _fsync_tree(tmp)
    dst.parent.mkdir(parents=True, exist_ok=True)
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
    """Removes temporary folders left by killed runs (never served: their names start with '.');
    a variant's partial folder stays for the next run to resume, unless untouched for a week."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.endswith((".partial", ".partial.lock")) and time.time() - p.stat().st_mtime > STALE_PARTIAL_S:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            continue  # a first start nobody resumed for a week
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
        h.update(sha256_file(f).encode())
    memo[stamp] = h.hexdigest()
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:  # a read-only cache (replicas mounting what a Job quantized): just compute
        pass
    return memo[stamp]
