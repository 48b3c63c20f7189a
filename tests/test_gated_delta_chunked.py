"""The chunked gated delta rule equals mlx-lm's per-token recurrence within float tolerance."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from mixbit.models.forward.gated_delta_chunked import chunked_gated_delta


def inputs(B, T, Hk, Hv, Dk, Dv, seed=0):
    mx.random.seed(seed)
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)),
                        inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0.0, 3.0, (B, T, Hv)))  # strong and weak decays
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)) * 2)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("B, T, Hk, Hv, Dk, Dv", [
    (1, 1, 1, 1, 32, 32), (2, 7, 2, 4, 64, 64), (1, 64, 2, 2, 64, 32), (1, 65, 1, 2, 32, 64),
    (3, 131, 2, 4, 64, 64), (1, 300, 4, 8, 128, 128),
])
def test_matches_recurrence(B, T, Hk, Hv, Dk, Dv):
    q, k, v, g, beta, state = inputs(B, T, Hk, Hv, Dk, Dv)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, g, beta, state)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert mx.allclose(y, y_ref, atol=2e-5, rtol=1e-4).item()
    assert mx.allclose(s, s_ref, atol=2e-5, rtol=1e-4).item()


def test_mask_leaves_state_untouched_at_padding():
    q, k, v, g, beta, state = inputs(2, 90, 2, 4, 64, 64, seed=3)
    mask = mx.ones((2, 90), dtype=mx.bool_)
    mask[0, :17] = False  # left padding of a shorter prompt in a batch
    mask[1, 40:45] = False
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    y, s = chunked_gated_delta(q, k, v, g, beta, state, mask)
    keep = mask[:, :, None, None]
    assert mx.allclose(mx.where(keep, y, 0), mx.where(keep, y_ref, 0), atol=2e-5, rtol=1e-4).item()
    assert mx.allclose(s, s_ref, atol=2e-5, rtol=1e-4).item()


def test_state_carries_across_calls():
    q, k, v, g, beta, state = inputs(1, 200, 2, 4, 64, 64, seed=5)
    y_all, s_all = chunked_gated_delta(q, k, v, g, beta, state)
    cut = 77  # not a multiple of the chunk
    y1, s1 = chunked_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state)
    y2, s2 = chunked_gated_delta(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    assert mx.allclose(mx.concatenate([y1, y2], axis=1), y_all, atol=2e-5).item()
    assert mx.allclose(s2, s_all, atol=2e-5).item()


@pytest.mark.parametrize("route", ["chunked", "kernel"])
def test_model_output_is_the_per_token_loops(loaded_tiny, route):
    """The whole embedded model gives the same logits with its recurrence on the CPU kernel or
    in the chunked form as with mlx-lm's per-token loop (`gated_delta_update`)."""
    from mixbit.models import kernels
    from mixbit.models.forward.qwen3_5 import GatedDeltaNet

    if route == "kernel" and not kernels.available():
        pytest.skip(kernels.IMPORT_ERROR)
    ids = mx.array([loaded_tiny.tokenizer.encode("Hello there, what is the weather in Oslo? " * 12)])
    layers = [m for _, m in loaded_tiny.model.named_modules() if isinstance(m, GatedDeltaNet)]
    before = [m.recurrence for m in layers]
    try:
        logits = {}
        for name in (route, "mlx"):
            for m in layers:
                m.recurrence = name
            logits[name] = loaded_tiny.model(ids, phase="score")
    finally:
        for m, r in zip(layers, before):
            m.recurrence = r
    assert mx.allclose(logits[route], logits["mlx"], atol=1e-3, rtol=1e-3).item()


def test_prompt_pass_does_not_keep_every_layers_conv_input_alive(embedded_path):
    """A GatedDeltaNet layer evaluates what it leaves in the cache (the conv state, a copy of the
    conv input's last rows, and the new recurrent state) before the next layer runs. Lazily
    they kept every layer's whole conv input and chunk intermediates alive until the end of the
    pass (the 0.8B shape, 8x300 tokens: 2.17 GB above the weights at the peak, 0.80 GB after).
    Served packed, as at real size (each kernel call is a synchronisation point): same results,
    a lower peak by more than one layer's conv input."""
    from mlx_lm.models.cache import make_prompt_cache

    from mixbit.models import kernels
    from mixbit.models.forward.qwen3_5 import GatedDeltaNet

    from .test_kernels import _packed_and_dense

    if not kernels.available():
        pytest.skip(kernels.IMPORT_ERROR)
    model, _ = _packed_and_dense(embedded_path, lambda p: True, activations="float32")
    layers = [m for _, m in model.named_modules() if isinstance(m, GatedDeltaNet)]
    B, T = 8, 1024
    tokens = (mx.arange(B * T, dtype=mx.int32).reshape(B, T) % 1000) + 5
    runs = {}
    try:
        for name, evaluate in (("evaluated", True), ("lazy", False)):
            for m in layers:
                m.evaluate_cache = evaluate
            mx.eval(model.parameters())
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            cache = make_prompt_cache(model)
            model(tokens, cache=cache)  # PREFILL: the logits are never evaluated
            mx.eval([c.state for c in cache])
            step = model(tokens[:, :1], cache=cache)[:, -1]  # a decode step reads the cache
            runs[name] = (mx.get_peak_memory() - base, np.array(step))
            del cache
    finally:
        for m in layers:
            m.evaluate_cache = True
    conv_input = B * (T + layers[0].conv_kernel_size - 1) * layers[0].conv_dim * 4
    assert runs["evaluated"][0] + conv_input <= runs["lazy"][0], (runs["evaluated"][0], runs["lazy"][0])
    np.testing.assert_allclose(runs["evaluated"][1], runs["lazy"][1], rtol=1e-5, atol=1e-5)
