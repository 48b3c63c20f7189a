"""The writer's quantizer: MLX's own packed format (stock MLX dequantizes it), scales and biases
fitted per group, never worse than MLX's round-to-nearest at the same bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mixbit.models import kernels
from mixbit.quant.formats import BITS, GROUPS, Format, dequantize, fit_affine, pack, quantize


@pytest.mark.parametrize("bits", BITS)
def test_codes_pack_as_mlx_unpacks_them(bits):
    codes = mx.array(np.random.default_rng(bits).integers(0, 2 ** bits, size=(6, 256)), dtype=mx.uint8)
    ones, zeros = mx.ones((6, 4), dtype=mx.float32), mx.zeros((6, 4), dtype=mx.float32)
    got = mx.dequantize(pack(codes, bits), ones, zeros, group_size=64, bits=bits)
    assert np.array_equal(np.array(got), np.array(codes).astype(np.float32))
    ref, _, _ = mx.quantize(mx.zeros((6, 256)), group_size=64, bits=bits)
    assert pack(codes, bits).shape == ref.shape and pack(codes, bits).dtype == ref.dtype


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_fitted_groups_never_lose_to_round_to_nearest(bits, group):
    # heavy-tailed rows, like trained weights, one constant group and one all-zero row
    rng = np.random.default_rng(bits * group)
    w = rng.standard_t(3, size=(64, 512)).astype(np.float32) * 0.02
    w[3, :group] = 0.5
    w[7] = 0.0
    w = mx.array(w).astype(mx.bfloat16)
    fmt = Format(bits, group)
    packed, scales, biases = quantize(w, fmt)
    assert scales.dtype == mx.bfloat16 and biases.dtype == mx.bfloat16
    mine = dequantize(packed, scales, biases, fmt)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    rtn = dequantize(q, s, b, fmt)
    x = w.astype(mx.float32)
    err = ((mine - x) ** 2).reshape(64, -1, group).sum(-1)
    err_rtn = ((rtn - x) ** 2).reshape(64, -1, group).sum(-1)
    assert mx.all(err <= err_rtn * (1 + 1e-3) + 1e-12).item()  # per group
    assert err.sum().item() < 0.97 * err_rtn.sum().item() or bits == 8
    assert mx.array_equal(mine[3, :group], x[3, :group]).item() and mx.all(mine[7] == 0).item()


def test_stacked_experts_and_row_chunks_are_fitted_like_one_matrix(monkeypatch):
    import mixbit.quant.formats as F

    w = mx.random.normal((4, 96, 128), key=mx.random.key(1)) * 0.02
    whole = quantize(w, Format(4, 64))
    monkeypatch.setattr(F, "FIT_ELEMENTS", 128 * 50)  # chunks of 50 rows, across expert bounds
    chunked = quantize(w, Format(4, 64))
    one_stream = quantize(w, Format(4, 64), streams=1)  # the same bits on one stream
    for a, b, c in zip(whole, chunked, one_stream):
        assert a.shape[:2] == (4, 96) and mx.array_equal(a, b).item() and mx.array_equal(a, c).item()
    codes, _, _ = fit_affine(w.reshape(-1, 128), Format(4, 64))
    assert codes.dtype == mx.uint8 and int(codes.max().item()) <= 15


@pytest.mark.skipif(not kernels.fit_available(), reason="mixbit's kernels are not built here")
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_the_fit_on_the_kernels_gives_the_same_bits_as_in_mlx(portable):
    # the writer fits on the kernels; the MLX fit is the reference (and the fallback without them)
    rng = np.random.default_rng(7)
    w = rng.standard_t(3, size=(67, 512)).astype(np.float32) * 0.02  # 67 rows: groups not a multiple of 8
    w[::9] *= 40
    w[3, :128] = 0.25  # constant groups at every group size
    w[5] = 0.0
    w[6, 256:] = rng.standard_normal(256) * 1e-6
    cases = [mx.array(w).astype(mx.bfloat16), mx.array(w),  # stored bf16, and float32 (AWQ-scaled)
             mx.array(rng.standard_normal((3, 40, 128)).astype(np.float32)).astype(mx.bfloat16)]  # stacked
    kernels._qkernel.force_portable(portable)
    try:
        for x in cases:
            for bits in BITS:
                for group in GROUPS:
                    fmt = Format(bits, group)
                    a, b = quantize(x, fmt, kernel=False), quantize(x, fmt, kernel=True)
                    for u, v in zip(a, b):
                        assert u.dtype == v.dtype and u.shape == v.shape, (fmt, x.dtype, x.shape)
                        assert mx.array_equal(u, v).item(), (fmt.name, x.dtype, x.shape)
    finally:
        kernels._qkernel.force_portable(False)


def test_the_quantize_time_check_measures_the_variant_as_written(tmp_path):
    """recipe.json's measured_kld (the writer's streamed check) is the KLD of the variant as
    loaded, on the same held-out rows: the check reads back the fitted tables and layers."""
    import json

    from mixbit.models.loading import load
    from mixbit.models.registry import resolve
    from mixbit.quant import calibration as calib
    from mixbit.quant.compare import token_klds
    from mixbit.quant.variants import quantize as quantize_variant

    resolved = resolve("embedded:tiny-qwen3.5")
    quantize_variant(resolved, "uniform-4", tmp_path / "u4")
    recipe = json.loads((tmp_path / "u4" / "recipe.json").read_text())
    assert recipe["tensors"]["language_model.model.embed_tokens"]["format"] == "q4g64"  # the tied head too
    ref = load(resolved)
    rows = calib.build(ref.tokenizer, n_rows=4, length=64, split="heldout").rows
    klds, _ = token_klds(ref, load(resolved, path=tmp_path / "u4", dequantize=True), rows)
    assert recipe["measured_kld"] == pytest.approx(float(klds.mean().item()), rel=0.02)
