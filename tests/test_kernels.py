"""The packed CPU kernels (models/kernels): built at install, and what they compute is what MLX
computes for the dequantized weight, for every width and group size the recipes use, for any
number of rows, on each instruction-set path (AVX-512, AVX2, portable C); a model served packed gives the logits
the dense model gives."""

from __future__ import annotations


import numpy as np
import pytest

from mixbit.models import kernels

mx = pytest.importorskip("mlx.core")

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"no kernels: {kernels.IMPORT_ERROR}")


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


@pytest.fixture(params=["native", "avx2", "portable"])
def isa(request):
    """Each instruction-set path this CPU can run: all it has, AVX2 at most (the path of CPUs
    without AVX-512), portable C."""
    if not kernels.available():
        pytest.skip(f"no kernels: {kernels.IMPORT_ERROR}")
    kernels._qkernel.force_isa(request.param)
    try:
        if request.param == "avx2" and kernels.info()["isa"] != "avx2":
            pytest.skip("this CPU has no AVX2 with FMA")
        yield request.param
    finally:
        kernels._qkernel.force_isa("native")


@needs_kernels
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
                         + [(16, 0)])
def test_matches_dequantized_matmul(bits, group, isa):
    for m, n, k in ((1, 67, 256), (5, 33, 384), (9, 129, 128), (17, 8, 512)):
        x, w, s, b = _case(m, n, k, bits, group or 64, seed=m)
        got = np.array(kernels.matmul(x, w, s, b, bits, group))
        ref = _reference(x, w, s, b, bits, group)
        assert got.shape == (m, n)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@needs_kernels
@pytest.mark.parametrize("bits,group", [(3, 64), (4, 128), (5, 32), (6, 64), (8, 32), (16, 0)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits, group, isa):
    """A decode row gives the same bits alone, in a batch, or as one position of a verify step
    (speculative decoding's exactness rests on it): every row count of a pass and beyond."""
    x, w, s, b = _case(11, 70, 512, bits, group or 64, seed=bits)
    alone = np.concatenate([np.array(kernels.matmul(x[i:i + 1], w, s, b, bits, group)) for i in range(11)])
    for m in (2, 3, 4, 5, 8, 11):
        np.testing.assert_array_equal(np.array(kernels.matmul(x[:m], w, s, b, bits, group)), alone[:m])


def _modes_here():
    """The matmul modes this CPU runs as themselves (INT16 and the panels need VNNI, TILES AMX)."""
    modes = [kernels.FLOAT, kernels.BLAS]
    if kernels.info().get("vnni"):
        modes += [kernels.INT16, kernels.PANEL, kernels.PANEL8]
    if kernels.tiles_available():
        modes.append(kernels.TILES)
    return modes


@needs_kernels
@pytest.mark.parametrize("bits,group", [(2, 128), (3, 64), (4, 128), (5, 64), (6, 32), (8, 64)])
def test_bfloat16_scales_as_stored_give_the_float32_products(bits, group, isa):
    """A variant stores its scales and biases in bfloat16; the kernels read them so (half the
    bytes of float32 copies, in memory and in every decode row) with bit for bit the products of
    the same values in float32, in every mode, for decode rows and prompts."""
    x, w, s, b = _case(40, 128, 512, bits, group, seed=bits)
    s16, b16 = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    s32, b32 = s16.astype(mx.float32), b16.astype(mx.float32)
    for mode in _modes_here():
        for rows in (1, 3, 40):
            got = np.array(kernels.matmul(x[:rows], w, s16, b16, bits, group, mode=mode))
            np.testing.assert_array_equal(got, np.array(kernels.matmul(x[:rows], w, s32, b32, bits, group,
                                                                        mode=mode)))
    ref = _reference(x, w, s32, b32, bits, group)
    np.testing.assert_allclose(np.array(kernels.matmul(x, w, s16, b16, bits, group)), ref, rtol=1e-4,
                               atol=1e-4 * np.abs(ref).max())


@needs_kernels
def test_leading_dimensions_and_dtypes():
    x, w, s, b = _case(6, 40, 256, 4, 64)
    x3 = x.reshape(2, 3, 256).astype(mx.bfloat16)
    got = kernels.matmul(x3, w, s, b, 4, 64)
    assert got.shape == (2, 3, 40) and got.dtype == mx.float32
    ref = _reference(x3.reshape(6, 256).astype(mx.float32), w, s, b, 4, 64)
    np.testing.assert_allclose(np.array(got).reshape(6, 40), ref, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_float32_views_as_inputs():
    """A float32 input goes to the kernel as it is (no copy, no new MLX node): a slice with an
    offset, a transposed view (refused by the kernel, then copied) and a broadcast one."""
    x, w, s, b = _case(12, 40, 256, 4, 64)
    big = mx.random.normal((3, 12, 256))
    for view in (big[1], big[:, 5], x.T.T, mx.transpose(mx.random.normal((256, 7))),
                 mx.broadcast_to(x[:1], (5, 256))):
        ref = _reference(mx.contiguous(view), w, s, b, 4, 64)
        np.testing.assert_allclose(np.array(kernels.matmul(view, w, s, b, 4, 64)), ref, rtol=1e-4,
                                   atol=1e-4 * np.abs(ref).max())


@needs_kernels
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
    with pytest.raises(ValueError, match="float32 or bfloat16"):  # scales and biases of two types
        q.matmul(x, w, s.astype(mx.bfloat16), b, out, 2, 16, 128, 4, 64)
    a, y = np.ones(64, np.float32), np.empty(64, np.float32)
    with pytest.raises(ValueError, match="b: 128 bytes, expected 256"):
        q.silu(a, a[:32], y, 64)
    with pytest.raises(ValueError, match="writable"):
        q.silu(a, None, b"\0" * 256, 64)
    with pytest.raises(ValueError, match="w: 64 bytes, expected 128"):
        q.depthwise_conv(np.ones((1, 11, 8), np.float32), a[:16], np.empty((1, 8, 8), np.float32), 1, 8, 4, 8)
    with pytest.raises(ValueError, match="state"):
        q.gated_delta_scan(*[np.ones(4, np.float32)] * 3, *[np.ones(1, np.float32)] * 2, a,
                           np.empty(4, np.float32), np.empty(16, np.float32), 1, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="bad shape"):
        q.gated_delta_scan(*[a] * 8, 1, 0, 1, 4, 4)


def _quantized(embedded_path, quantize_path, classes=True):
    """The embedded model, float32, in mixbit's forward (`classes`; else mlx-lm's qwen3_5, the
    reference), with its Linear/Embedding layers at paths where `quantize_path` holds quantized
    to 4 bits (group 64)."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    from mixbit.models.forward.qwen3_5 import model_classes

    model, _ = load_model(embedded_path, **({"get_model_classes": model_classes} if classes else {}))
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding))
                and m.weight.shape[-1] % 64 == 0 and quantize_path(p))
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    return model


def _packed_and_dense(embedded_path, quantize_path, activations: str | None = None):
    """The embedded model twice (`_quantized`): the first built from a rule plan for
    `activations` that serves every quantized layer packed (None: left unbuilt), the second
    dequantized back to dense."""
    from mixbit.models.forward.plan import rule_plan
    from mixbit.models.forward.qwen3_5 import build

    packed, dense = _quantized(embedded_path, quantize_path), _quantized(embedded_path, quantize_path)
    if activations is not None:
        build(packed, rule_plan(packed, activations, small=0))  # even the tiny model's layers
    build(dense, None)
    return packed, dense


@needs_kernels
def test_model_served_packed_gives_dense_logits(embedded_path):
    """The embedded model quantized to 4 bits, served packed (every projection and the tied head
    on the kernels, prompts through the transient dense path; GatedDeltaNet's recurrence and
    conv and the SiLUs on the kernels too) and dense: the same logits for a batch
    of two 160-token prompts and three decode steps."""
    from mixbit.models.forward.plan import rule_plan
    from mixbit.models.forward.qwen3_5 import GatedDeltaNet, build

    packed, dense = _packed_and_dense(embedded_path, lambda p: "mlp" in p or "embed" in p)
    counts = build(packed, rule_plan(packed, "auto", small=0))  # even the tiny model's layers
    assert counts["packed"] > 0 and counts["dense"] == 0
    kinds = {type(m).__name__ for _, m in packed.named_modules()}
    assert {"PackedLinear", "PackedEmbedding"} <= kinds
    # the convolution and its SiLU, the gated norm's and the MLP's SiLUs on the kernels
    convs = [m for _, m in packed.named_modules() if isinstance(m, GatedDeltaNet)]
    assert convs and all(c.fused for c in convs)
    reference = _quantized(embedded_path, lambda p: "mlp" in p or "embed" in p, classes=False)
    from mixbit.models.loading import _dequantize

    _dequantize(reference)  # mlx-lm's own qwen3_5 over the same dequantized weights
    tokens = (mx.arange(2 * 160, dtype=mx.int32).reshape(2, 160) * 37) % 4000 + 5
    # the prompt is large enough for the SiLU kernel (MLX's op below kernels.ACT_MIN values)
    assert tokens.size * packed.args.text_config["intermediate_size"] >= kernels.ACT_MIN
    from mlx_lm.models.cache import make_prompt_cache

    outs = {}
    for name, model in (("packed", packed), ("dense", dense), ("mlx-lm", reference)):
        cache = make_prompt_cache(model)  # prompt, then decode steps (one row: the kernels)
        logits = [model(tokens, cache=cache)[:, -1]]
        for t in (7, 11, 13):
            logits.append(model(mx.array([[t], [t + 1]]), cache=cache)[:, -1])
        outs[name] = np.array(mx.concatenate(logits))
    np.testing.assert_allclose(outs["dense"], outs["mlx-lm"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs["packed"], outs["dense"], rtol=1e-3, atol=1e-3)
    assert (outs["packed"].argmax(-1) == outs["dense"].argmax(-1)).all()


@needs_kernels
@pytest.mark.parametrize("bits,group", [(2, 64), (3, 128), (4, 64), (5, 32), (6, 128), (8, 128), (16, 0)])
def test_blas_mode_for_prompts_matches(bits, group, isa):
    """Many rows: the weight dequantized in tiles and multiplied by the process's cblas_sgemm
    (OpenBLAS, loaded by models/blas.py as `mixbit` does)."""
    assert kernels.blas_available(), "the tests load OpenBLAS (conftest) like `mixbit` does"
    x, w, s, b = _case(300, 200, 256, bits, group or 64)
    got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.BLAS))
    ref = _reference(x, w, s, b, bits, group)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


needs_tiles = pytest.mark.skipif(not kernels.tiles_available(), reason="no AMX tiles on this CPU or kernel")


@needs_kernels
@needs_tiles
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
                         + [(16, 0)])
def test_tiles_mode_for_prompts_matches(bits, group):
    """Many rows on the AMX tiles: x split exactly into three bfloat16 parts, so the products
    are exact and the result is float32 accumulation away from the float64 product: rows not a
    multiple of the tile, more rows than one pass (kernels TILE_MCHUNK = 256), several column
    panels, a K so long that a panel is one block of columns, and decode batches (up to 16 rows
    run as one block of 16, also a pass's last rows)."""
    for m, n, k in ((16, 32, 128), (45, 96, 384), (300, 160, 256), (40, 64, 8192), (1, 64, 256),
                    (8, 96, 384), (260, 64, 256)):
        x, w, s, b = _case(m, n, k, bits, group or 64, seed=m)
        got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.TILES))
        dense = (w.astype(mx.float32) if bits == 16 else
                 mx.dequantize(w, s, b, group_size=group, bits=bits))
        ref = np.array(x).astype(np.float64) @ np.array(dense).astype(np.float64).T
        assert got.shape == (m, n)
        # three parts: at most 1e-6 over these cases; two (16 significant bits of x): 3.5e-5
        assert np.abs(got - ref).max() <= 4e-6 * np.abs(ref).max(), (m, n, k)


@needs_kernels
@needs_tiles
def test_tiles_mode_from_threads_that_end():
    """x's parts live in buffers kept per thread and freed when the thread ends (engine restarts
    start new threads): several threads, each its own prompt, then gone."""
    import threading

    x, w, s, b = _case(300, 64, 512, 4, 64)
    ref = _reference(x, w, s, b, 4, 64)
    got = {}

    def work(i):
        mx.eval(x, w, s, b)
        got[i] = np.array(kernels.matmul(x, w, s, b, 4, 64, mode=kernels.TILES))

    for _ in range(2):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 3
        for out in got.values():
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        got.clear()


@needs_kernels
def test_tiles_mode_refuses_what_it_cannot_do():
    x, w, s, b = _case(40, 48, 256, 4, 64)
    out = np.empty((40, 48), np.float32)
    if not kernels.tiles_available():
        with pytest.raises(RuntimeError, match="AMX"):
            kernels._qkernel.matmul(x, w, s, b, out, 40, 48, 256, 4, 64, kernels.TILES)
        return
    with pytest.raises(ValueError, match="multiple of 32"):  # 48 output columns
        kernels._qkernel.matmul(x, w, s, b, out, 40, 48, 256, 4, 64, kernels.TILES)
    assert not kernels.tiles_support(48, 256, 4, 64) and kernels.tiles_support(64, 256, 4, 64)


needs_int16 = pytest.mark.skipif(not (kernels.available() and kernels.info().get("vnni")),
                                 reason="no AVX-512 VNNI here: the INT16 mode computes as FLOAT")


@needs_int16
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)])
def test_int16_mode_is_within_its_bound(bits, group):
    """The INT16 mode takes each group of x as 16-bit integers (x16 = round(x / d), d = the
    group's largest |x| / 32512) and multiplies them exactly: its only error against the
    dequantized weight's product is x's rounding, at most sum over groups of |scale| * sum(q) * d/2
    (plus float32 rounding), even beside an outlier channel 30x the others."""
    for m, n, k in ((1, 67, 256), (5, 33, 384), (9, 129, 128), (17, 8, 512)):
        x, w, s, b = _case(m, n, k, bits, group, seed=m)
        x = x * mx.where(mx.arange(k) % 97 == 3, 30.0, 1.0)
        got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.INT16))
        ref = _reference(x, w, s, b, bits, group)
        sn, bn = np.array(s), np.array(b)
        q = (np.array(mx.dequantize(w, s, b, group_size=group, bits=bits)) - np.repeat(bn, group, 1)) / \
            np.repeat(sn, group, 1)
        d = np.abs(np.array(x)).reshape(m, -1, group).max(-1) / 32512
        bound = np.einsum("ng,mg->mn", np.abs(q).reshape(n, -1, group).sum(-1) * np.abs(sn), d / 2)
        assert (np.abs(got - ref) <= bound + 1e-5 * np.abs(ref).max()).all()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) > 1e-7  # integers, not the float path
    x, w, _, _ = _case(3, 40, 256, 16, 64)  # bfloat16 weights: the float path, exactly
    np.testing.assert_array_equal(np.array(kernels.matmul(x, w, mode=kernels.INT16)),
                                  np.array(kernels.matmul(x, w)))


@needs_int16
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)])
def test_panel_mode_computes_what_int16_computes(bits, group):
    """PANEL (many rows: the weights unpacked into panels of 64 columns, vpdpwssd) rounds x as
    INT16 does and multiplies exactly, so it gives INT16's result to float32 rounding - every
    width and group, rows not a multiple of its register tile (6), one row, more rows than a
    pass (512), an outlier channel - and is within INT16's bound of the float64 product."""
    for m, n, k in ((1, 64, 256), (13, 128, 384), (64, 192, 128), (520, 64, 256)):
        x, w, s, b = _case(m, n, k, bits, group, seed=m)
        x = x * mx.where(mx.arange(k) % 97 == 3, 30.0, 1.0)
        got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.PANEL))
        int16 = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.INT16))
        ref = _reference(x, w, s, b, bits, group)
        assert got.shape == (m, n)
        scale = np.abs(ref).max()
        assert np.abs(got - int16).max() <= 2e-6 * scale, (m, n, k)
        assert np.abs(got - ref).max() <= 5e-4 * scale and np.abs(got - ref).max() > 0, (m, n, k)


@needs_int16
@pytest.mark.parametrize("bits,group", [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)])
def test_int8_panel_mode_rounds_x_to_8_bits_and_multiplies_exactly(bits, group):
    """PANEL8 (PANEL's panels, x as 8-bit integers per group, vpdpbusd) gives exactly what the
    float64 product of the dequantized weight with x rounded to 8 bits per group (round(x / d),
    d = the group's largest |x| / 127) gives - to float32 rounding - every width and group, rows
    not a multiple of the register tile, one row, more rows than a pass, an outlier channel; and
    it is within the 8-bit rounding's bound of the exact product, not within INT16's."""
    for m, n, k in ((1, 64, 256), (13, 128, 384), (64, 192, 128), (520, 64, 256)):
        x, w, s, b = _case(m, n, k, bits, group, seed=m)
        x = x * mx.where(mx.arange(k) % 97 == 3, 30.0, 1.0)
        got = np.array(kernels.matmul(x, w, s, b, bits, group, mode=kernels.PANEL8))
        # rounded as the kernel rounds: x * (127 / amax) in float32, to nearest even
        xg = np.array(x, np.float32).reshape(m, k // group, group)
        amax = np.abs(xg).max(-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        x8 = (np.rint(xg * inv).astype(np.float64) * (amax / np.float32(127))).reshape(m, k)
        wd = np.array(mx.dequantize(w, s, b, group_size=group, bits=bits), np.float64)
        exact = np.array(x, np.float64) @ wd.T
        # w = s q + b per group; the kernel takes s q against the rounded x and b against x's own
        # group sums: the rounded product plus b times what the rounding took off each group
        lost = (np.array(x, np.float64) - x8).reshape(m, k // group, group).sum(-1)  # [m, groups]
        rounded = x8 @ wd.T + lost @ np.array(b, np.float64).T
        scale = np.abs(exact).max()
        assert got.shape == (m, n)
        assert np.abs(got - rounded).max() <= 2e-5 * scale, (m, n, k)
        err = np.abs(got - exact).max()
        assert 5e-4 * scale < err <= 0.2 * scale, (m, n, k, err / scale)


@needs_kernels
def test_panel_mode_refuses_what_it_cannot_do():
    x, w, s, b = _case(40, 96, 256, 4, 64)
    out = np.empty((40, 96), np.float32)
    if not kernels.info().get("vnni"):
        for mode in (kernels.PANEL, kernels.PANEL8):
            with pytest.raises(RuntimeError, match="VNNI"):
                kernels._qkernel.matmul(x, w, s, b, out, 40, 96, 256, 4, 64, mode)
        assert not kernels.panel_support(128, 256, 4, 64)
        return
    for mode in (kernels.PANEL, kernels.PANEL8):
        with pytest.raises(ValueError, match="multiple of 64"):  # 96 output columns
            kernels._qkernel.matmul(x, w, s, b, out, 40, 96, 256, 4, 64, mode)
    with pytest.raises(ValueError, match="mode must be"):
        kernels._qkernel.matmul(x, w, s, b, out, 40, 96, 256, 4, 64, 6)
    assert not kernels.panel_support(96, 256, 4, 64) and kernels.panel_support(128, 256, 4, 64)
    assert not kernels.panel_support(128, 256, 16, 0)


@needs_int16
def test_decode_activations_setting(embedded_path):
    """The plan's activations: "float32" keeps every decode row on the float kernel, "int16" puts
    every packed affine layer on the integer one ("int8" too, its prompts on 8-bit panels),
    "auto" decides per shape by timing (the measured plan says which); the model's decode logits
    differ by far less than quantization moves them (KLD < 1e-5 between the two, same greedy
    tokens), "int8" changes nothing but the PREFILL phase, and a bad value is refused."""
    from mixbit.models.forward.plan import measure_plan, rule_plan
    from mixbit.models.forward.qwen3_5 import build

    models = {}
    for act in ("float32", "int16", "int8", "auto"):
        model = _quantized(embedded_path, lambda p: "mlp" in p or "embed" in p)
        cpu_plan = (measure_plan(model, "packed", act, small=0) if act == "auto"
                    else rule_plan(model, act, small=0))
        build(model, cpu_plan)
        plan = cpu_plan.summary()
        assert {r["decode"] for r in plan["shapes"]} <= ({"float32"} if act == "float32" else
                                                          {"int16"} if act in ("int16", "int8") else
                                                          {"float32", "int16"})
        # every packed layer runs its decode rows as the plan says for its shape
        planned = {(r["out"], r["in"], r["bits"], r["group"]): r["decode"] for r in plan["shapes"]}
        packed = [m for _, m in model.named_modules() if type(m).__name__.startswith("Packed")]
        assert packed and all(m.decode_mode == {"float32": kernels.FLOAT, "int16": kernels.INT16}[
            planned[kernels.shape_key(m)]] for m in packed)
        # prompts: no integer panels under "float32", the 16-bit ones wherever they run under
        # "int16", the 8-bit ones under "int8"
        for r in plan["shapes"]:
            if act == "float32":
                assert r["prefill"] not in ("panel", "panel8")
            elif act in ("int16", "int8") and kernels.panel_support(r["out"], r["in"], r["bits"], r["group"]):
                assert r["prefill"] == {"int16": "panel", "int8": "panel8"}[act]
        models[act] = model
    from mlx_lm.models.cache import make_prompt_cache

    logits = {}
    for act in ("float32", "int16"):
        model = models[act]
        cache = make_prompt_cache(model)
        model(mx.array([[5, 9, 200, 31, 77, 1024]]), cache=cache)
        steps = [model(mx.array([[t]]), cache=cache)[:, -1] for t in (7, 11, 13, 300, 8, 9)]
        logits[act] = mx.concatenate(steps)
    lp = {a: v - mx.logsumexp(v, -1, keepdims=True) for a, v in logits.items()}
    kld = float((mx.exp(lp["float32"]) * (lp["float32"] - lp["int16"])).sum(-1).max())
    assert 0 < kld < 1e-5, kld
    assert bool(mx.all(logits["float32"].argmax(-1) == logits["int16"].argmax(-1)))

    # "int8": 8-bit activations only in the PREFILL phase (the engine's prompts), where a request
    # reads the prompt only through the state it leaves; teacher-forced scoring (SCORE: fidelity,
    # prompt logprobs), output heads and decode batches compute exactly what "int16" computes
    from mlx_lm.models.cache import ArraysCache

    prompt = mx.array([[5, 9, 200, 31, 77, 1024, 17, 3, 99, 450, 12, 6] * 2])  # past the rule plan's 16 rows
    batch = mx.array([[7], [11], [13], [300], [8], [9]])
    scored, states, stepped = {}, {}, {}
    for act in ("int16", "int8"):
        model = models[act]
        scored[act] = model(prompt, phase="score")  # teacher-forced
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)  # several positions, no phase: PREFILL
        states[act] = [c[1] for c in cache if isinstance(c, ArraysCache)]  # GatedDeltaNet states
        batched = make_prompt_cache(model)
        model(mx.repeat(prompt, 6, 0), cache=batched, phase="score")  # the same state in every row
        stepped[act] = model(batch, cache=batched)  # then one batch step (one position: DECODE)
        mx.eval(scored[act], states[act], stepped[act])
    np.testing.assert_array_equal(np.array(scored["int8"]), np.array(scored["int16"]))
    np.testing.assert_array_equal(np.array(stepped["int8"]), np.array(stepped["int16"]))
    gap = max(float(mx.abs(a - b).max() / mx.abs(b).max()) for a, b in zip(states["int8"], states["int16"]))
    assert 1e-5 < gap < 0.1, gap  # the prefill did run on 8-bit activations, close to 16-bit ones
    model = _quantized(embedded_path, lambda p: "embed" in p)
    with pytest.raises(ValueError, match="activations"):
        rule_plan(model, "int4", small=0)
    with pytest.raises(ValueError, match="phase"):
        models["int16"](prompt, phase="warmup")


def test_built_at_install():
    """`pip install -e .` (make setup) compiles the kernels wherever a C compiler exists: a
    silently skipped build must not pass as a skipped test."""
    import shutil
    import sys

    if shutil.which("cc") or shutil.which("gcc"):
        assert kernels.available(), kernels.IMPORT_ERROR
        if sys.platform == "linux" and __import__("platform").machine() == "x86_64":
            assert kernels.info()["isa"] in ("avx512-vbmi", "avx2", "portable")


@needs_kernels
def test_the_instruction_sets_can_be_capped_from_the_environment():
    """MIXBIT_KERNEL_ISA (docs/cpu-serving.md) caps the paths a process's kernels use: the plan
    of a variant is then measured for that path, which is how benchmarks compare them."""
    import os
    import subprocess
    import sys

    def isa(value):
        env = {k: v for k, v in os.environ.items() if k != "MIXBIT_KERNEL_ISA"}
        if value is not None:
            env["MIXBIT_KERNEL_ISA"] = value
        out = subprocess.run([sys.executable, "-c", "from mixbit.models import kernels; "
                              "print(kernels.info()['isa'])"], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    native = isa(None)
    assert isa("portable") == "portable"
    assert isa("avx2") == ("portable" if native == "portable" else "avx2")
    assert isa("native") == isa("anything else") == native


@needs_kernels
@pytest.mark.parametrize("B,Hk,Hv,Dk,Dv", [(1, 2, 4, 64, 64), (3, 16, 16, 128, 128), (2, 1, 2, 48, 32)])
def test_gated_delta_step_matches_mlx_lm(B, Hk, Hv, Dk, Dv, isa):
    """The decode step of the gated delta rule against mlx-lm's own step ops, several steps in a
    row (the state carried)."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(B + Dk)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    ref_state = state
    for _ in range(3):
        q = mx.random.normal((B, 1, Hk, Dk)) * 0.1
        k = mx.random.normal((B, 1, Hk, Dk)) * 0.1
        v = mx.random.normal((B, 1, Hv, Dv))
        g = mx.random.uniform(0.5, 1.0, (B, 1, Hv))
        beta = mx.random.uniform(0.0, 1.0, (B, 1, Hv))
        y, state = kernels.gated_delta(q, k, v, g, beta, state)
        ref_y, ref_state = gated_delta_ops(q, k, v, g, beta, ref_state)
        np.testing.assert_allclose(np.array(y), np.array(ref_y), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(state), np.array(ref_state), rtol=1e-4, atol=1e-5)


@needs_kernels
def test_reused_output_buffers_never_alias_results():
    """Decode-sized outputs (1-8 MB) reuse one buffer per shape, within a bound; what a call
    returned stays as it was after the next call with the same shape."""
    B, H, D = 2, 16, 128  # a 2 MB state
    mx.random.seed(5)
    state = mx.random.normal((B, H, D, D)) * 0.1
    args = [mx.random.normal((B, 1, H, D)) * 0.1 for _ in range(2)] + [mx.random.normal((B, 1, H, D))]
    gates = [mx.random.uniform(0.5, 1.0, (B, 1, H)), mx.random.uniform(0.0, 1.0, (B, 1, H))]
    _, first = kernels.gated_delta(*args, *gates, state)
    kept = np.array(first)
    _, second = kernels.gated_delta(*args, *gates, first)
    assert np.array_equal(np.array(first), kept) and not np.array_equal(np.array(second), kept)
    assert kernels._output((B, H, D, D), "state") is kernels._output((B, H, D, D), "state")
    big = (kernels.SCRATCH_MAX // 4 + 1,)
    assert kernels._output(big) is not kernels._output(big)  # a prompt's output is not kept
    for rows in range(1, 40):
        kernels._output((rows, 1 << 18))
    assert sum(b.nbytes for b in kernels._scratch.bufs.values()) <= kernels.SCRATCH_BYTES


@needs_kernels
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(1, 37, 2, 4, 64, 64), (2, 130, 16, 16, 128, 128), (3, 5, 1, 2, 48, 32)])
def test_gated_delta_over_a_prompt_matches_mlx_lm(B, T, Hk, Hv, Dk, Dv, isa):
    """A prompt's tokens in one kernel call, left-padded rows masked as the batch generator
    does, against mlx-lm's token-by-token ops: the same outputs and final state."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(T + Dk)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    q = mx.random.normal((B, T, Hk, Dk)) * 0.1
    k = mx.random.normal((B, T, Hk, Dk)) * 0.1
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    mask = mx.arange(T)[None, :] >= mx.array([i * 3 for i in range(B)])[:, None]  # left padding
    y, new = kernels.gated_delta(q, k, v, g, beta, state, mask)
    ref_y, ref_new = gated_delta_ops(q, k, v, g, beta, state, mask)
    keep = np.array(mask)
    np.testing.assert_allclose(np.array(y)[keep], np.array(ref_y)[keep], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(new), np.array(ref_new), rtol=1e-4, atol=1e-5)
    assert not np.array_equal(np.array(new), np.array(state))


@needs_kernels
@pytest.mark.parametrize("B,L,C", [(1, 4, 6144), (3, 303, 512), (2, 70, 40)])
def test_depthwise_conv_matches_mlx(B, L, C):
    """GatedDeltaNet's short convolution (kernel 4, one filter per channel) against MLX's."""
    mx.random.seed(L)
    x = mx.random.normal((B, L, C))
    w = mx.random.normal((C, 4, 1))
    ref = mx.conv1d(x, w, groups=C)
    got = kernels.depthwise_conv(x, mx.contiguous(w[..., 0].T))
    assert got.shape == ref.shape == (B, L - 3, C)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


@needs_kernels
@needs_kernels
def test_silu_after_the_conv_is_the_silu_of_the_conv():
    """The conv with its SiLU applied on the kernel (GatedDeltaNet's, in a fused layer) is
    MLX's SiLU of the conv."""
    import mlx.nn as nn

    x = mx.random.normal((2, 70, 600))
    w_t = mx.random.normal((4, 600))
    conv = np.array(kernels.depthwise_conv(x, w_t))
    fused = kernels.depthwise_conv(x, w_t, then_silu=True)
    np.testing.assert_allclose(np.array(fused), np.array(nn.silu(mx.array(conv))), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_silu_matches_mlx():
    """SiLU (and SiLU times a second input) over a prompt's worth of values, extremes included,
    against MLX's; below kernels.ACT_MIN values it is MLX's own op."""
    import mlx.nn as nn

    mx.random.seed(3)
    a = mx.concatenate([mx.random.normal((kernels.ACT_MIN + 1000,)) * 8,
                        mx.array([-100.0, -88.0, -87.0, 0.0, 87.0, 88.0, 100.0, 1e-30, -1e-30])])
    b = mx.random.normal(a.shape)
    np.testing.assert_allclose(np.array(kernels.silu(a)), np.array(nn.silu(a)), rtol=3e-6, atol=1e-30)
    np.testing.assert_allclose(np.array(kernels.silu(a, b)), np.array(nn.silu(a) * b), rtol=3e-6, atol=1e-30)
    small = a[:100]
    assert np.array_equal(np.array(kernels.silu(small)), np.array(nn.silu(small)))
    # a decode step's kernel outputs (evaluated): the kernel for any size, strided ones copied
    small_b = b[:100]
    mx.eval(small, small_b)
    np.testing.assert_allclose(np.array(kernels.silu(small, small_b, evaluated=True)),
                               np.array(nn.silu(small) * small_b), rtol=3e-6, atol=1e-30)
    strided = mx.random.normal((40, 30)).T
    mx.eval(strided)
    np.testing.assert_allclose(np.array(kernels.silu(strided, strided, evaluated=True)),
                               np.array(nn.silu(strided) * strided), rtol=3e-6, atol=1e-30)


@needs_kernels
def test_decode_rows_take_their_silus_on_the_kernels(embedded_path, monkeypatch):
    """A decode step of a packed model: each GatedDeltaNet layer's whole step (conv, SiLUs,
    gates, recurrence, gated norm) is one kernel call, the MLP's SiLU of its gate (both
    projections on the kernels, their outputs evaluated) runs on the kernel, and the logits are
    MLX's own ops' to rounding."""
    from mlx_lm.models.cache import make_prompt_cache

    from mixbit.models.forward.qwen3_5 import GatedDeltaNet

    # float32 activations: INT16 decode rows' logits differ from dense by ~1e-3 of their scale,
    # the bound below
    packed, dense = _packed_and_dense(embedded_path, lambda p: True, activations="float32")
    layers = packed.args.text_config["num_hidden_layers"]
    linear = sum(1 for _, m in packed.named_modules() if isinstance(m, GatedDeltaNet) and m.fused)
    prompt = mx.array([[5, 9, 11, 40, 7, 3]])
    logits = {}
    for name, model in (("packed", packed), ("dense", dense)):
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        if name == "packed":
            real, calls, steps = kernels._qkernel, [], []

            class Counting:
                def __getattr__(self, attr):
                    return getattr(real, attr)

                def silu(self, *args):
                    calls.append(args[3])
                    return real.silu(*args)

                def gdn_decode_step(self, *args):
                    steps.append(args[13])  # the batch
                    return real.gdn_decode_step(*args)

            monkeypatch.setattr(kernels, "_qkernel", Counting())
        logits[name] = np.array(model(mx.array([[17]]), cache=cache))
        monkeypatch.undo()
        if name == "packed":
            sizes = packed.args.text_config
            assert calls.count(sizes["intermediate_size"]) == layers  # every MLP
            assert steps == [1] * linear  # every GatedDeltaNet layer: one call for its whole step
    np.testing.assert_allclose(logits["packed"], logits["dense"], rtol=1e-3, atol=1e-3)


@needs_kernels
def test_load_time_measurement_never_builds_a_whole_dense_copy(monkeypatch):
    """`measure_plan` times each layer shape dense and packed at load; dense float32 is timed on a part
    of the rows (the 0.8B shape's load peaked at 6.9 GB resident for a 439 MB variant when every
    shape's whole dense copy was built and kept in MLX's cache)."""
    import mlx.nn as nn

    monkeypatch.setattr(kernels, "DENSE_PROBE_BYTES", 1 << 20, raising=False)
    layer = nn.QuantizedLinear(2048, 8192, bias=False, group_size=64, bits=4)
    layer.scales = layer.scales.astype(mx.float32)
    layer.biases = layer.biases.astype(mx.float32)
    mx.eval(layer.parameters())
    dense_bytes = 8192 * 2048 * 4  # 64 MB
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    timings = kernels.measure(layer, rows=(1,), budget_s=0.005)
    assert mx.get_peak_memory() - base < dense_bytes / 4, mx.get_peak_memory() - base
    assert timings[1]["dense"] > 0 and timings[1]["kernel"] > 0
    assert mx.get_cache_memory() < dense_bytes / 4  # nothing left behind for the next shape


@needs_kernels
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_logsumexp_matches_a_float64_reference(portable):
    """The normalisation of a real vocabulary's logits (248,320 a row, batch 1 and 8, grammar-masked
    and logit-biased entries among them) against float64, at least as close as MLX's own; the
    edge rows as MLX gives them; other inputs are MLX's op itself."""
    kernels._qkernel.force_portable(portable)
    try:
        mx.random.seed(5)
        for rows in (1, 8):
            x = np.array(mx.random.normal((rows, 248320)) * 6)
            x[:, :1000] = -np.inf  # a grammar mask
            x[:, 1000:1010] -= 100.0  # logit_bias
            want = np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
            got = kernels.logsumexp(mx.array(x), axis=-1, keepdims=True)
            mlx_err = np.abs(np.array(mx.logsumexp(mx.array(x), axis=-1, keepdims=True)) - want).max()
            assert got.shape == (rows, 1) and got.dtype == mx.float32
            assert np.abs(np.array(got) - want).max() <= max(mlx_err, 3e-5)
        n = kernels.LSE_MIN
        edge = np.zeros((5, n), np.float32)
        edge[0] = -np.inf
        edge[1, 7] = np.inf
        edge[2, n // 2] = np.nan
        edge[3, :-1], edge[3, -1] = -np.inf, 3.0
        edge[4] = 1e30
        got = np.array(kernels.logsumexp(mx.array(edge), axis=-1))
        assert got[0] == -np.inf and got[1] == np.inf and np.isnan(got[2]) and got[3] == 3.0
        np.testing.assert_allclose(got[4], 1e30, rtol=1e-6)
        b = mx.random.normal((2, n)).astype(mx.bfloat16)
        assert kernels.logsumexp(b, axis=-1).dtype == mx.bfloat16
        np.testing.assert_allclose(np.array(kernels.logsumexp(b, axis=-1).astype(mx.float32)),
                                   np.array(mx.logsumexp(b, axis=-1).astype(mx.float32)), rtol=1e-2)
        for a, kw in ((mx.random.normal((3, n - 1)), {"axis": -1}), (mx.random.normal((n, 2)), {"axis": 0}),
                      (mx.random.normal((2, n)), {})):
            assert np.array_equal(np.array(kernels.logsumexp(a, **kw)), np.array(mx.logsumexp(a, **kw)))
        with pytest.raises(ValueError, match="empty"):  # as MLX's own op says
            kernels.logsumexp(mx.zeros((0, n)), axis=-1)
        with pytest.raises(ValueError, match="y: 4 bytes, expected 8"):
            kernels._qkernel.logsumexp(np.ones((2, 4), np.float32), np.empty(1, np.float32), 2, 4)
    finally:
        kernels._qkernel.force_portable(False)


@needs_kernels
def test_decode_steps_normalise_on_the_kernels(loaded_tiny, monkeypatch):
    """mixbit's decode loop normalises every decode step's logits with kernels.logsumexp: on the
    kernels from LSE_MIN values a row (here 16, so the embedded model's 4,096 engage), MLX's op
    below. Greedy tokens are the same and the log-probabilities agree."""
    from mixbit.server.batching import BatchLoop

    calls = []
    real = kernels._qkernel.logsumexp
    monkeypatch.setattr(kernels._qkernel, "logsumexp", lambda *a: calls.append(a[2:]) or real(*a))
    tok = loaded_tiny.tokenizer
    prompts = [tok.encode("What's the weather in Oslo?"), tok.encode("Write a haiku about the sea.")]

    def run():
        loop = BatchLoop(loaded_tiny.model, stop_tokens=[], max_batch=2)
        uids = [loop.insert([p], 6) for p in prompts]
        out = {u: ([], []) for u in uids}
        while len(out[uids[0]][0]) < 6:
            _, generated = loop.next()
            for r in generated:
                out[r.uid][0].append(r.token)
                out[r.uid][1].append(np.array(r.logprobs))
        return [out[u] for u in uids]

    monkeypatch.setattr(kernels, "LSE_MIN", 1 << 30)
    mlx_run = run()
    assert not calls
    monkeypatch.setattr(kernels, "LSE_MIN", 16)
    kernel_run = run()
    assert calls and all(c == (2, 4096) or c == (1, 4096) for c in calls)
    for (t_mlx, lp_mlx), (t_k, lp_k) in zip(mlx_run, kernel_run):
        assert t_mlx == t_k
        np.testing.assert_allclose(np.array(lp_k), np.array(lp_mlx), atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("Hk,Hv,masked", [(2, 2, False), (2, 4, False), (2, 4, True)])
def test_fused_decode_step_is_the_layers_step(Hk, Hv, masked, isa):
    """GatedDeltaNet's decode step in one kernel call (kernels.gdn_decode_step) gives the output
    and the conv and recurrent states of the step-by-step path (conv and SiLU, normalize_qk,
    gates, the delta rule, the gated norm); a masked row leaves its states as they were."""
    from mlx_lm.models.cache import ArraysCache
    from mlx_lm.models.qwen3_5 import TextModelArgs

    from mixbit.models.forward.qwen3_5 import GatedDeltaNet

    args = TextModelArgs(model_type="qwen3_5_text", hidden_size=64, linear_num_key_heads=Hk,
                         linear_num_value_heads=Hv, linear_key_head_dim=32, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4)
    mx.random.seed(5)
    layer = GatedDeltaNet(args)  # MLX's random initialisation; A_log spread over (0, log 16)
    mx.eval(layer.parameters())
    prompt, step = mx.random.normal((2, 5, 64)), mx.random.normal((2, 1, 64))
    mask = mx.array([[True], [False]]) if masked else None
    outs = {}
    for fused in (False, True):
        layer.fused = False
        cache = ArraysCache(size=2)
        layer(prompt, cache=cache, phase="prefill")
        before = [mx.array(c) for c in cache.cache]
        if fused:
            layer.fuse()
        y = layer(step, mask=mask, cache=cache, phase="decode")
        outs[fused] = (np.array(y), [np.array(c) for c in cache.cache], [np.array(c) for c in before])
    (y0, s0, _), (y1, s1, before) = outs[False], outs[True]
    np.testing.assert_allclose(y1, y0, rtol=1e-4, atol=1e-5)
    for a, b in zip(s1, s0):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if masked:  # the padded row's recurrent state is the prompt's
        np.testing.assert_allclose(s1[1][1], before[1][1], rtol=1e-6, atol=1e-7)
