"""The chunked gated delta rule equals mlx-lm's per-token recurrence within float tolerance."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from mixbit.models.gated_delta_chunked import chunked_gated_delta


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


def test_installed_model_output_is_unchanged(loaded_tiny):
    """The whole embedded model gives the same logits through mixbit's route for the recurrence
    (the CPU kernel where built, else the chunked form) and through mlx-lm's per-token loop."""
    import mlx_lm.models.qwen3_5 as q35

    ids = mx.array([loaded_tiny.tokenizer.encode("Hello there, what is the weather in Oslo? " * 12)])
    patched = q35.gated_delta_update
    assert getattr(patched, "__wrapped__", None) is not None, "mixbit's loader installs its route for the recurrence"
    fast = loaded_tiny.model(ids)
    q35.gated_delta_update = patched.__wrapped__
    try:
        slow = loaded_tiny.model(ids)
    finally:
        q35.gated_delta_update = patched
    assert mx.allclose(fast, slow, atol=1e-3, rtol=1e-3).item()


def test_prompt_pass_does_not_keep_every_layers_conv_input_alive(embedded_path):
    """A GatedDeltaNet layer evaluates what it leaves in the cache (the conv state, a copy of the
    conv input's last rows, and the new recurrent state) before the next layer runs. Lazily
    they kept every layer's whole conv input and chunk intermediates alive until the end of the
    pass (the 0.8B shape, 8x300 tokens: 2.17 GB above the weights at the peak, 0.80 GB now).
    Served packed, as at real size (each kernel call is a synchronisation point): same results,
    a lower peak by more than one layer's conv input."""
    import mlx.nn as nn
    import mlx_lm.models.qwen3_5 as q35
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load as mlx_load

    from mixbit.models import gated_delta_chunked, kernels

    if not kernels.available():
        pytest.skip(kernels.IMPORT_ERROR)
    gated_delta_chunked.install()
    model, _ = mlx_load(str(embedded_path))
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: isinstance(
        m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 64 == 0)
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    kernels.serve(model, "packed", small=0)
    evaluated = q35.GatedDeltaNet.__call__
    assert getattr(evaluated, "__wrapped__", None) is not None
    B, T = 8, 1024
    tokens = (mx.arange(B * T, dtype=mx.int32).reshape(B, T) % 1000) + 5
    runs = {}
    try:
        for name, call in (("evaluated", evaluated), ("lazy", evaluated.__wrapped__)):
            q35.GatedDeltaNet.__call__ = call
            mx.eval(model.parameters())
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            cache = make_prompt_cache(model)
            with kernels.prompt_logits_unused():
                model(tokens, cache=cache)
                mx.eval([c.state for c in cache])
            step = model(tokens[:, :1], cache=cache)[:, -1]  # a decode step reads the cache
            runs[name] = (mx.get_peak_memory() - base, np.array(step))
            del cache
    finally:
        q35.GatedDeltaNet.__call__ = evaluated
    layer = model.language_model.model.layers[0].linear_attn
    conv_input = B * (T + layer.conv_kernel_size - 1) * layer.conv_dim * 4
    assert runs["evaluated"][0] + conv_input <= runs["lazy"][0], (runs["evaluated"][0], runs["lazy"][0])
    np.testing.assert_allclose(runs["evaluated"][1], runs["lazy"][1], rtol=1e-5, atol=1e-5)
