"""Shared fixtures: the repository root, the embedded model, and a way to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixbit.models.blas import ensure_fast_blas

ensure_fast_blas()  # in-process tests get the BLAS the CLI loads, before anything imports mlx

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "tiny-qwen3.5"
# the tools the README's examples offer (get_weather, ...), as the OpenAI SDK takes them
WEATHER = json.loads((ROOT / "examples" / "weather.json").read_text())
MIXBIT = [sys.executable, "-m", "mixbit.server.cli"]


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 300):
    """Runs `mixbit ARGS` as a user would, in a clean environment (no MIXBIT_* leaking in)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
    base["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(MIXBIT + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})}, cwd=str(cwd or ROOT))


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    assert (EMBEDDED / "config.json").is_file(), "the embedded model is missing from models/"
    return EMBEDDED


@pytest.fixture(scope="session")
def loaded_tiny():
    """The embedded model through mixbit's loader (mlx-lm underneath), float32 on CPU."""
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    return load(resolve("embedded:tiny-qwen3.5"))
