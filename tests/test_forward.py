"""mixbit's own Qwen3.5 forward (models/forward) against mlx-lm's qwen3_5, the reference: the same
logits for the dense and the MoE layout (random-weight checkpoints in the published layout, with
an MTP head), its MTP head loaded from the checkpoint, and the states after each position of a
multi-token step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

_PATH = Path(__file__).resolve().parent / "bench" / "real_shapes.py"
_spec = importlib.util.spec_from_file_location("real_shapes", _PATH)
rs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("real_shapes", rs)  # dataclasses look their module up
_spec.loader.exec_module(rs)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def checkpoint(request, tmp_path_factory):
    return rs.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0)


def _steps(model, tokens, cache, phase=None):
    kw = {} if phase is None else {"phase": phase}
    out = [model(tokens, cache=cache, **kw)[:, -1]]
    for t in (7, 11):
        out.append(model(mx.array([[t]] * tokens.shape[0]), cache=cache)[:, -1])
    return np.array(mx.concatenate(out).astype(mx.float32))


def test_same_logits_as_mlx_lm(checkpoint):
    from mlx_lm.utils import load as mlx_load

    from mixbit.models.forward.qwen3_5 import Model
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    reference, _ = mlx_load(str(checkpoint))
    reference.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    ours = load(resolve(str(checkpoint), allow_download=False), cpu_quantized="dense").model
    assert isinstance(ours, Model)
    tokens = (mx.arange(2 * 40, dtype=mx.int32).reshape(2, 40) * 37) % 4000 + 5
    want = _steps(reference, tokens, reference.make_cache())
    got = _steps(ours, tokens, ours.make_cache(), phase="score")
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


def test_the_mtp_head_is_loaded_from_the_checkpoint(checkpoint):
    from mixbit.models.forward.qwen3_5 import MTP
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    model = load(resolve(str(checkpoint), allow_download=False), cpu_quantized="dense").model
    assert isinstance(model.mtp, MTP) and len(model.mtp.layers) == 1
    stored = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        stored.update({k: v for k, v in mx.load(str(f)).items() if k.startswith("mtp.")})
    assert "mtp.fc.weight" in stored
    assert mx.array_equal(model.mtp.fc.weight, stored["mtp.fc.weight"].astype(mx.float32))
    experts = [k for k in stored if ".mlp.experts." in k]  # MoE: one tensor per expert, stacked
    if experts:
        assert model.mtp.layers[0].mlp.switch_mlp.gate_proj.weight.shape[0] == model.args.text_config["num_experts"]
    h = mx.random.normal((1, 3, model.args.text_config["hidden_size"]))
    out = model.mtp(model.model.embed_tokens(mx.array([[5, 6, 7]])), h, phase="score")
    assert out.shape == h.shape and bool(mx.all(mx.isfinite(out)))


def test_states_after_each_position(loaded_tiny):
    """A step of four tokens keeps each GatedDeltaNet layer's conv and recurrent states after
    every position; the state after position t is what a step ending at t leaves in the cache,
    and the logits are those of the plain step."""
    model = loaded_tiny.model
    prompt = mx.array([loaded_tiny.tokenizer.encode("The weather in Oslo is")])
    step = mx.array([[11, 12, 13, 14]])
    cache = model.make_cache()
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    states: dict = {}
    logits = model(step, cache=cache, phase="decode", states=states)
    assert sorted(states) == [i for i, layer in enumerate(model.layers) if layer.is_linear]
    for t in range(4):
        short = model.make_cache()
        model(prompt, cache=short)
        plain = model(step[:, :t + 1], cache=short, phase="decode")
        np.testing.assert_allclose(np.array(plain), np.array(logits[:, :t + 1]), rtol=1e-4, atol=1e-4)
        for i, (conv, rec) in states.items():
            np.testing.assert_allclose(np.array(conv[t]), np.array(short[i][0]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.array(rec[t]), np.array(short[i][1]), rtol=1e-4, atol=1e-5)
    # rolled back to two of the four positions, the cache continues as a step of two left it
    model.rollback(cache, states, kept=2, verified=4)
    short = model.make_cache()
    model(prompt, cache=short)
    model(step[:, :2], cache=short, phase="decode")
    nxt = mx.array([[21]])
    np.testing.assert_allclose(np.array(model(nxt, cache=cache, phase="decode")),
                               np.array(model(nxt, cache=short, phase="decode")), rtol=1e-4, atol=1e-4)
