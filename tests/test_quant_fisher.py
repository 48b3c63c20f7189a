"""The cheap sensitivity estimator ranks tensors like the ablation does (on the embedded model)."""

from mixbit.quant import calibration as calib
from mixbit.quant.sensitivity import fisher_estimate, measure, spearman


def test_fisher_estimate_ranks_like_the_ablation(loaded_tiny):
    cal = calib.build(loaded_tiny.tokenizer, n_rows=4, length=64)
    ablation = measure(loaded_tiny.model, cal, bits=(3, 4))
    fisher = fisher_estimate(loaded_tiny.model, cal, bits=(3, 4))
    rho, n = spearman(ablation, fisher)
    assert n == 2 * len(ablation.kld)
    assert rho > 0.9, rho  # measured 0.99 on 16 rows x 128 tokens (tests/bench/sensitivity_bench.py)
    # and the model is left as it was: the ablation again gives the same numbers
    again = measure(loaded_tiny.model, cal, bits=(3,))
    p = next(iter(again.kld))
    assert abs(again.kld[p]["q3g64"] - ablation.kld[p]["q3g64"]) < 1e-6
