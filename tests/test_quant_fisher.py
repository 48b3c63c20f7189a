"""The cheap sensitivity estimator ranks tensors like the ablation does (on the embedded model)."""

import pytest

from mixbit.models import kernels
from mixbit.models.loading import load
from mixbit.models.registry import resolve
from mixbit.quant import calibration as calib
from mixbit.quant.sensitivity import fisher_estimate, measure, spearman


def test_fisher_estimate_ranks_like_the_ablation():
    lm = load(resolve("embedded:tiny-qwen3.5"), cpu_quantized="dense")  # as variants._fisher loads it
    cal = calib.build(lm.tokenizer, n_rows=4, length=64)
    ablation = measure(lm.model, cal, bits=(3, 4))
    fisher = fisher_estimate(lm.model, cal, bits=(3, 4))
    rho, n = spearman(ablation, fisher)
    assert n == 2 * len(ablation.kld)
    assert rho > 0.9, rho  # measured 0.99 on 16 rows x 128 tokens (tests/bench/sensitivity_bench.py)
    # and the model is left as it was: the ablation again gives the same numbers
    again = measure(lm.model, cal, bits=(3,))
    p = next(iter(again.kld))
    assert abs(again.kld[p]["q3g64"] - ablation.kld[p]["q3g64"]) < 1e-6


@pytest.mark.skipif(not kernels.available(), reason="mixbit's CPU kernels are not built here")
def test_fisher_refuses_a_model_served_on_the_forward_only_kernels():
    # packed, not auto: auto times both per shape, and on an AVX2-only CPU dense float32 wins for
    # every projection of the embedded model, so nothing would be served on the kernels
    lm = load(resolve("embedded:tiny-qwen3.5"), cpu_quantized="packed")
    from mixbit.models.forward.layers import is_packed

    assert any(is_packed(m) for _, m in lm.model.named_modules())
    cal = calib.build(lm.tokenizer, n_rows=1, length=16)
    with pytest.raises(ValueError, match="cpu_quantized='dense'"):
        fisher_estimate(lm.model, cal, bits=(4,))
