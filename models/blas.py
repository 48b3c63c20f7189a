"""An optimized BLAS under MLX's CPU matmuls on Linux, whoever launched the process.

MLX's Linux wheel links `cblas_sgemm` from the reference BLAS it bundles. Loading an OpenBLAS
into the global symbol scope *before* `mlx.core` is imported makes the dynamic linker bind MLX's
calls to it instead (as `LD_PRELOAD` would, but from inside the process, so `mixbit serve` run
directly, from a venv, a container or a unit file, is as fast as `make serve`). Measured here
(tests/bench/blas_bench.py): a 512x1024x3584 float32 matmul took 498 ms on the bundled BLAS,
15.6 ms on Debian's OpenBLAS 0.3.21 and 8.6 ms on the `cmeel-openblas` wheel's 0.3.31.

Candidates, first that loads and runs on this CPU wins: a BLAS already in the process (LD_PRELOAD), the
`cmeel-openblas` wheel (a dependency on Linux; it needs the system's libgfortran.so.5), then a
system OpenBLAS. With none, one loud warning says what it costs. macOS uses Accelerate.
"""

from __future__ import annotations

import ctypes
import os
import glob
import logging
import sys
from dataclasses import dataclass

log = logging.getLogger("mixbit.blas")

SYSTEM_CANDIDATES = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",  # Arch, Alpine
)
COST = ("MLX's bundled reference BLAS is about 30x slower at float32 matmuls here (a 512-token "
        "prefill ~4x slower end to end; the embedded model's first start ~48 min instead of ~3)")


# What an OpenBLAS built for one x86 core (no DYNAMIC_ARCH) executes: the cmeel-openblas 0.3.31
# wheel is built for SKYLAKEX, and on a CPU without AVX-512 (an AMD EPYC with AVX2 only, say) its
# first sgemm is an illegal instruction that kills the process.
CORE_NEEDS = {
    "SAPPHIRERAPIDS": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16"},
    "COOPERLAKE": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    "SKYLAKEX": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "ZEN": {"avx2", "fma"},
    "HASWELL": {"avx2", "fma"},
    "SANDYBRIDGE": {"avx"},
    "NEHALEM": set(), "CORE2": set(), "PRESCOTT": set(),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runs_here(config: str, core: str, machine: str, flags: set[str]) -> str:
    """Why an OpenBLAS with this build `config` and `core` cannot run on this CPU, or ''."""
    if machine not in ("x86_64", "AMD64") or "DYNAMIC_ARCH" in config:
        return ""
    needs = CORE_NEEDS.get(core.upper())
    if needs is None:
        return f"built for {core} only, a core mixbit cannot check"
    missing = needs - flags
    return f"built for {core} only; this CPU lacks {', '.join(sorted(missing))}" if missing else ""


def _check(path: str) -> str:
    """Loads `path` privately (its symbols not yet visible to MLX) and returns why it cannot run
    here, or ''. A later global load of the same path promotes this one."""
    import platform

    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        config = (lib.openblas_get_config() or b"").decode(errors="replace")
        core = (lib.openblas_get_corename() or b"").decode(errors="replace")
    except AttributeError:  # not an OpenBLAS: nothing to check
        return ""
    return runs_here(config, core, platform.machine(), _cpu_flags())


@dataclass
class BlasChoice:
    name: str  # "preloaded", "cmeel-openblas", "system", "accelerate", "none"
    path: str = ""
    error: str = ""  # why there is none; with one: the candidates passed over and why


_CHOICE: BlasChoice | None = None


def _already_loaded() -> str:
    """The path of an OpenBLAS this process already has (LD_PRELOAD), or ''."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libopenblas" in line or "libmkl_rt" in line or "libblis" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return ""


def _wheel_paths() -> list[str]:
    from importlib import metadata

    try:
        files = metadata.files("cmeel-openblas") or []
    except metadata.PackageNotFoundError:
        return []
    return [str(f.locate()) for f in files if str(f).endswith("lib/libopenblas.so.0")]


def _system_paths() -> list[str]:
    return [p for pattern in SYSTEM_CANDIDATES for p in sorted(glob.glob(pattern))]


def _return_large_frees() -> None:
    """glibc raises its mmap threshold after each large free (up to 32 MB), so the transient
    buffers of prompt processing (BLAS tiles, activations of 8 x 300-token prefills) end up in
    heaps it never gives back: a 0.8B variant held 2.7 GB resident after one such prefill, with
    0.73 GB in use. A fixed 1 MB threshold returns them (1.3 GB). Harmless elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_free_memory() -> None:
    """Gives the C heap's free pages back to the system (glibc's malloc_trim). Loading leaves
    hundreds of MB free but resident in small-allocation heaps: parsing Qwen3.5's 33 MB
    tokenizer.json alone leaves ~190 MB (a tokenizer resident at 280 MB, 91 MB after), ~260 MB
    with transformers' wrapper. Called once the server is loaded, and by the engine each time it
    goes idle (a burst's freed small allocations). Harmless elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def ensure_fast_blas() -> BlasChoice:
    """Loads the best BLAS before MLX (idempotent). Call before the first `import mlx.core`."""
    global _CHOICE
    if _CHOICE is not None:
        return _CHOICE
    if sys.platform == "darwin":
        _CHOICE = BlasChoice("accelerate")
        return _CHOICE
    if not sys.platform.startswith("linux"):
        _CHOICE = BlasChoice("none", error=f"no BLAS selection on {sys.platform}")
        return _CHOICE
    loaded = _already_loaded()
    if loaded:
        _CHOICE = BlasChoice("preloaded", loaded)
        return _CHOICE
    if "mlx.core" in sys.modules:
        _CHOICE = BlasChoice("none", error="mlx.core was imported before mixbit chose a BLAS")
        return _CHOICE
    _return_large_frees()
    # OpenBLAS's idle threads spin for about 2^28 cycles after each call by default; on a small
    # machine they then compete with the packed kernels' threads in the next decode step
    # (0.8B shape, 2 cores: decode step batch 8 313 -> 246 ms with this; docs/cpu-serving.md).
    # Read when OpenBLAS initializes, so set before it loads; a user's own value stays.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    errors = []
    for name, paths in (("cmeel-openblas", _wheel_paths()), ("system", _system_paths())):
        for path in paths:
            try:
                why = _check(path)
                if why:
                    errors.append(f"{path}: {why}")
                    continue
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(f"{path}: {exc}")
                continue
            _CHOICE = BlasChoice(name, path, error="; ".join(errors))  # the ones passed over
            return _CHOICE
    _CHOICE = BlasChoice("none", error="; ".join(errors) or "no OpenBLAS found")
    return _CHOICE


def report(logger: logging.Logger | None = None) -> BlasChoice:
    """Logs the choice once at start-up: one info line, or one loud warning without a fast BLAS."""
    choice = ensure_fast_blas()
    logger = logger or log
    if choice.name == "none":
        logger.warning("NO FAST BLAS: MLX's CPU matmuls run on its bundled reference BLAS (%s). %s. "
                       "Fix: `apt-get install libgfortran5` (for the cmeel-openblas wheel) or "
                       "`apt-get install libopenblas0-pthread`.", choice.error, COST)
    elif choice.name != "accelerate":
        logger.info("BLAS for MLX on CPU: %s (%s)%s", choice.name, choice.path,
                    f"; passed over: {choice.error}" if choice.error else "")
    return choice
