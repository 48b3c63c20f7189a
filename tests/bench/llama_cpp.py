"""llama.cpp, built from the sources the benches already use: the llama.cpp tree vendored in the
llama-cpp-python sdist from PyPI (the only way to its sources from this machine), into
.cache/llama.cpp, or the tree named by LLAMA_CPP_DIR. Built by the benches that need it when
missing, never by `make test`; tests that need it skip without it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA_BUILD = ROOT / ".cache" / "llama.cpp"
TOOLS = ("llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity", "llama-tokenize")

# ggml's x86 options by the /proc/cpuinfo flag that enables each
GGML_X86 = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
            "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
            "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}


def cpu_flags() -> list[str]:
    """cmake flags for this CPU's SIMD, AMX left out. A native build (-march=native) on an AMX Xeon
    crashed at load in ggml_backend_amx_mul_mat (a segmentation fault, gdb backtrace; llama.cpp
    from the llama-cpp-python 0.3.36 sdist), so the build names every other extension itself."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-DGGML_NATIVE=ON"]
    try:
        have = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{k}={'ON' if v in have else 'OFF'}" for k, v in GGML_X86.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def source_tree() -> Path | None:
    """The llama.cpp tree in use (LLAMA_CPP_DIR, else the one unpacked here), or None."""
    if os.environ.get("LLAMA_CPP_DIR"):
        return Path(os.environ["LLAMA_CPP_DIR"])
    trees = sorted(LLAMA_BUILD.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return trees[-1] if trees else None


def tool(name: str) -> Path | None:
    """A built llama.cpp program, or None."""
    src = source_tree()
    path = src / "build" / "bin" / name if src else None
    return path if path and path.exists() else None


def build(tools: tuple[str, ...] = TOOLS) -> Path:
    """Builds the missing `tools` (about 15 minutes on 2 cores the first time); the source tree."""
    src = source_tree()
    if src is None:
        LLAMA_BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(LLAMA_BUILD)], check=True)
        sdist = sorted(LLAMA_BUILD.glob("llama_cpp_python-*.tar.gz"))[-1]
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(LLAMA_BUILD)], check=True)
        src = source_tree()
    missing = [t for t in tools if not (src / "build" / "bin" / t).exists()]
    if missing:
        if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            raise SystemExit("building llama.cpp needs a C++ compiler: apt-get install g++ (or build-essential)")
        cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
        if not Path(cmake).exists():  # PyPI's cmake wheel, into this environment
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake>=3.28"], check=True)
        if not (src / "build" / "CMakeCache.txt").exists():
            subprocess.run([cmake, "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                            "-DLLAMA_OPENSSL=OFF", *cpu_flags(), "-DLLAMA_BUILD_TESTS=OFF",
                            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], cwd=src, check=True)
        subprocess.run([cmake, "--build", "build", "-j2", "--target", *missing], cwd=src, check=True)
    return src


def kl_divergence(model: Path, base: Path, n_ctx: int, tries: int = 3) -> dict:
    """llama-perplexity --kl-divergence of `model` against a base file, parsed
    (quant/llama_kld.parse_llama_perplexity). One thread: two spin-wait on a shared 2-core VM.
    llama.cpp logs from a background thread; on a loaded machine a run that exited 0 has lost
    its closing statistics (seen once in ~40 runs), so such a run is repeated."""
    from mixbit.quant.llama_kld import parse_llama_perplexity

    cmd = [str(tool("llama-perplexity")), "-m", str(model), "--kl-divergence-base", str(base),
           "--kl-divergence", "-c", str(n_ctx), "-b", str(n_ctx), "-t", "1"]
    for attempt in range(tries):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"llama-perplexity failed ({res.returncode}): {res.stderr[-1500:]}")
        try:
            return parse_llama_perplexity(res.stdout + res.stderr)
        except ValueError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")
