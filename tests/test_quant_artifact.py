"""The quantized artifact: stock mlx-lm loads it, damage is detected and rebuilt, a crash or a
kill mid-way leaves nothing that would be served."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mixbit.models.registry import resolve
from mixbit.quant import artifact
from mixbit.quant.variants import ensure_variant

from .conftest import ROOT


@pytest.fixture
def tiny():
    return resolve("embedded:tiny-qwen3.5")


@pytest.mark.parametrize("recipe, bpw", [("uniform-4", 4.5), ("uniform-3", 3.5), ("unsloth-static", None)])
def test_round_trip_through_stock_mlx_lm(tmp_path, tiny, recipe, bpw):
    from mlx_lm import generate, load

    v = ensure_variant(tiny, recipe, cache_dir=str(tmp_path))
    config = json.loads((v.path / "config.json").read_text())
    assert "quantization" in config
    recipe_json = json.loads((v.path / "recipe.json").read_text())
    assert recipe_json["recipe"] == recipe and recipe_json["tensors"]
    if bpw:
        assert abs(recipe_json["bits_per_weight"] - bpw) < 1e-6
    if recipe == "unsloth-static":
        assert any(t["bits"] == 16 for p, t in recipe_json["tensors"].items() if p.endswith("out_proj"))
    model, tok = load(str(v.path))
    assert isinstance(generate(model, tok, "Hello", max_tokens=3), str)
    assert artifact.verify(v.path) is None
    again = ensure_variant(tiny, recipe, cache_dir=str(tmp_path))
    assert again.path == v.path  # cached


@pytest.mark.parametrize("damage", ["truncate", "tamper", "delete"])
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, tiny, damage, caplog):
    v = ensure_variant(tiny, "uniform-4", cache_dir=str(tmp_path))
    weights = v.path / "model.safetensors"
    good = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(good[: len(good) // 2])
    elif damage == "tamper":
        weights.write_bytes(good[:-10] + bytes(10))
    else:
        weights.unlink()
    assert artifact.verify(v.path) is not None
    with caplog.at_level("WARNING", logger="mixbit.quant"):
        rebuilt = ensure_variant(tiny, "uniform-4", cache_dir=str(tmp_path))
    assert any("damaged" in r.message for r in caplog.records)
    assert rebuilt.path == v.path and artifact.verify(rebuilt.path) is None
    assert (rebuilt.path / "model.safetensors").read_bytes() == good


def test_crash_while_writing_leaves_no_entry(tmp_path, tiny, monkeypatch):
    import mlx.core as mx

    real_save = mx.save_safetensors

    def dying_save(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", dying_save)
    with pytest.raises(OSError):
        ensure_variant(tiny, "uniform-4", cache_dir=str(tmp_path))
    variants = tmp_path / "variants"
    assert [p.name for p in variants.iterdir() if not p.name.startswith(".")] == []
    monkeypatch.setattr(mx, "save_safetensors", real_save)
    v = ensure_variant(tiny, "uniform-4", cache_dir=str(tmp_path))
    assert artifact.verify(v.path) is None
    assert [p.name for p in variants.iterdir() if not p.name.endswith(".lock")] == [v.path.name]


def test_killed_quantize_leaves_nothing_to_serve(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
    cmd = [sys.executable, "-m", "mixbit.server.cli", "quantize", "--recipe", "mixbit-auto",
           "--set", f"model.cache_dir='{tmp_path}'"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(8)  # in the middle of measuring sensitivity
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    variants = tmp_path / "variants"
    served = [p for p in variants.iterdir() if not p.name.startswith(".")] if variants.exists() else []
    assert served == []


@pytest.mark.slow
def test_mixbit_auto_end_to_end(tmp_path, tiny):
    """Measure -> allocate -> AWQ -> write: under budget, mixed formats, fidelity recorded,
    and the sensitivity table is reused by the next build (a 20 s measurement budget instead
    of the default 120 s: the same steps, a shorter CI)."""
    budget = {"sensitivity_seconds": 20.0}
    started = time.time()
    v = ensure_variant(tiny, "mixbit-auto", cache_dir=str(tmp_path), target_bpw=4.5, **budget)
    first = time.time() - started
    r = json.loads((v.path / "recipe.json").read_text())
    assert r["bits_per_weight"] <= 4.5 + 1e-9
    assert len({t["format"] for t in r["tensors"].values()}) > 1  # not uniform
    assert r["predicted_kld"] >= 0 and r["measured_kld"] >= 0 and 0 < r["measured_top1"] <= 1
    assert r["awq"]["groups"] > 0
    assert all("sensitivity_kld" in t for t in r["tensors"].values())
    card = ensure_variant(tiny, "mixbit-auto", cache_dir=str(tmp_path), target_bpw=4.5, **budget).manifest
    assert card["recipe"] == "mixbit-auto" and card["measured_kld"] == r["measured_kld"]
    started = time.time()
    other = ensure_variant(tiny, "mixbit-auto", cache_dir=str(tmp_path), target_bpw=3.5, **budget)
    assert other.path != v.path
    assert time.time() - started < first  # the sensitivity table was reused
