"""AWQ: folding the scales into the norms leaves the unquantized function unchanged, and the
searched scales never make the quantization error of a group worse."""

import mlx.core as mx
import pytest

from mixbit.quant.awq import apply_awq
from mixbit.quant.formats import Format, quantizable


@pytest.fixture
def model_and_rows(embedded_path):
    from mlx_lm.utils import load_model

    model, _ = load_model(embedded_path)
    model.set_dtype(mx.float32)  # exact arithmetic for the equality check
    mx.random.seed(0)
    rows = mx.random.randint(0, 4000, (4, 64))
    return model, rows


def test_folding_keeps_the_function(model_and_rows):
    model, rows = model_and_rows
    before = model(rows)
    plan = {p: Format(3, 64) for p in quantizable(model)}
    results = apply_awq(model, rows, plan)
    assert results and any(r.alpha > 0 for r in results)  # scales were actually applied
    after = model(rows)
    assert mx.allclose(before, after, atol=1e-3, rtol=1e-3).item()


def test_search_never_increases_error(model_and_rows):
    model, rows = model_and_rows
    plan = {p: Format(3, 64) for p in quantizable(model)}
    for r in apply_awq(model, rows, plan):
        assert r.error_after <= r.error_before


def test_bf16_groups_are_left_alone(model_and_rows):
    model, rows = model_and_rows
    norms = [l.input_layernorm.weight for l in model.language_model.model.layers]
    assert apply_awq(model, rows, {}) == []
    for l, w in zip(model.language_model.model.layers, norms):
        assert mx.array_equal(l.input_layernorm.weight, w).item()
