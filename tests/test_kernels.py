"""The packed CPU kernels (models/kernels): built at install, and what they compute is what MLX
computes for the dequantized weight, for every width and group size the recipes use, for any
number of rows, on the fast path and the portable one; a model served packed gives the logits
the dense model gives."""

from __future__ import annotations

import numpy as np
import pytest

from mixbit.models import kernels

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"no kernels: {kernels.IMPORT_ERROR}")


def _reference(x, w, s, b, bits, group):
    if bits == 16:
        return np.array(x @ w.astype(mx.float32).T)
    return np.array(x @ mx.dequantize(w, s, b, group_size=group, bits=bits).T)


def _case(m, n, k, bits, group, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.05
    x = mx.random.normal((m, k))
    if bits == 16:
        wq, s, b = w.astype(mx.bfloat16), None, None
    else:
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    return x, wq, s, b


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
                         + [(16, 0)])
def test_matches_dequantized_matmul(bits, group, portable):
    kernels._qkernel.force_portable(portable)
    try:
        for m, n, k in ((1, 67, 256), (5, 33, 384), (9, 129, 128), (17, 8, 512)):
            x, w, s, b = _case(m, n, k, bits, group or 64, seed=m)
            got = np.array(kernels.matmul(x, w, s, b, bits, group))
            ref = _reference(x, w, s, b, bits, group)
            assert got.shape == (m, n)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    finally:
        kernels._qkernel.force_portable(False)


def test_leading_dimensions_and_dtypes():
    x, w, s, b = _case(6, 40, 256, 4, 64)
    x3 = x.reshape(2, 3, 256).astype(mx.bfloat16)
    got = kernels.matmul(x3, w, s, b, 4, 64)
    assert got.shape == (2, 3, 40) and got.dtype == mx.float32
    ref = _reference(x3.reshape(6, 256).astype(mx.float32), w, s, b, 4, 64)
    np.testing.assert_allclose(np.array(got).reshape(6, 40), ref, rtol=1e-4, atol=1e-4)


def test_bad_buffers_are_errors_not_crashes():
    x, w, s, b = _case(2, 16, 128, 4, 64)
    out = np.empty((2, 16), np.float32)
    q = kernels._qkernel
    with pytest.raises(ValueError, match="buffer sizes"):
        q.matmul(x, w, s, b, out, 2, 17, 128, 4, 64)  # N does not match the weight
    with pytest.raises(ValueError, match="bits"):
        q.matmul(x, w, s, b, out, 2, 16, 128, 7, 64)
    with pytest.raises(ValueError, match="group"):
        q.matmul(x, w, s, b, out, 2, 16, 128, 4, 48)
    with pytest.raises(ValueError, match="writable"):
        q.matmul(x, w, s, b, b"\0" * 128, 2, 16, 128, 4, 64)
    with pytest.raises(ValueError, match="contiguous"):
        q.matmul(x.T, w, s, b, out, 2, 16, 128, 4, 64)


def test_model_served_packed_gives_dense_logits(embedded_path):
    """The embedded model quantized to 4 and 6 bits, served packed (every projection and the
    tied head on the kernels, prompts through the transient dense path) and dense."""
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_load

    from mixbit.models.loading import _dequantize

    def quantized():
        model, _ = mlx_load(str(embedded_path))
        nn.quantize(model, group_size=64, bits=4,
                    class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding))
                    and m.weight.shape[-1] % 64 == 0 and ("mlp" in p or "embed" in p))
        model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
        return model

    packed, dense = quantized(), quantized()
    _dequantize(dense)
    summary = kernels.serve(packed, "packed", small=0)  # even the tiny model's layers
    assert summary["packed"] > 0 and summary["dense"] == 0
    kinds = {type(m).__name__ for _, m in packed.named_modules()}
    assert "PackedLinear" in kinds and "PackedEmbedding" in kinds
    tokens = mx.array([[1, 5, 9, 200, 17, 33, 4, 8]])
    for model in (packed, dense):  # prompt, then decode steps (one row: the kernels)
        from mlx_lm.models.cache import make_prompt_cache

        model._cache = make_prompt_cache(model)
    outs = {}
    for name, model in (("packed", packed), ("dense", dense)):
        logits = [model(tokens, cache=model._cache)[:, -1]]
        for t in (7, 11, 13):
            logits.append(model(mx.array([[t]]), cache=model._cache)[:, -1])
        outs[name] = np.array(mx.concatenate(logits))
    np.testing.assert_allclose(outs["packed"], outs["dense"], rtol=1e-3, atol=1e-3)
    assert (outs["packed"].argmax(-1) == outs["dense"].argmax(-1)).all()
