"""Bit allocation: respects the budget, prefers the cheaper of equal options, beats uniform."""

import pytest

from mixbit.quant.allocate import allocate, budget_for_bpw, options_for
from mixbit.quant.formats import Format
from mixbit.quant.sensitivity import SensitivityTable


def table(sens: dict[str, float], shape=(256, 256)) -> SensitivityTable:
    """KLD of each format = tensor sensitivity * 4^(-bits), a little worse for bigger groups."""
    kld, params, shapes = {}, {}, {}
    for path, s in sens.items():
        kld[path] = {}
        for bits in (2, 3, 4, 5, 6, 8):
            for group in (32, 64, 128):
                kld[path][Format(bits, group).name] = s * 4.0 ** (-bits) * (1 + group / 256)
        params[path] = shape[0] * shape[1]
        shapes[path] = list(shape)
    return SensitivityTable(kld=kld, params=params, shapes=shapes)


SENS = {"a.out_proj": 120.0, "b.q_proj": 5.0, "c.mlp.up_proj": 1.0, "d.mlp.down_proj": 2.0, "e.lm_head": 1.0}


@pytest.mark.parametrize("bpw", [2.5, 3.5, 4.5, 6.0])
def test_budget_is_respected(bpw):
    t = table(SENS)
    budget = budget_for_bpw(t, bpw)
    alloc = allocate(t, budget)
    assert alloc.nbytes <= budget + 1e-6
    assert alloc.bits_per_weight(t.params) <= bpw + 1e-9
    assert budget - alloc.nbytes < min(o.nbytes for o in alloc.choice.values())  # little left unspent


def test_sensitive_tensors_get_more_bits():
    t = table(SENS)
    alloc = allocate(t, budget_for_bpw(t, 4.5)).formats()
    assert alloc["a.out_proj"].bits_per_weight() > alloc["c.mlp.up_proj"].bits_per_weight()


def test_beats_uniform_at_equal_size():
    t = table(SENS)
    uniform = Format(4, 64)
    uniform_kld = sum(t.kld[p][uniform.name] for p in SENS)
    alloc = allocate(t, budget_for_bpw(t, uniform.bits_per_weight()))
    assert alloc.predicted_kld < uniform_kld / 2


def test_prefers_the_cheaper_of_equal_options():
    t = table({"x": 1.0})
    # make q4g32 and q4g64 equally good: the cheaper (g64) must win
    t.kld["x"]["q4g32"] = t.kld["x"]["q4g64"]
    names = [o.fmt.name for o in options_for(t, "x")]
    assert "q4g64" in names and "q4g32" not in names
    alloc = allocate(t, budget_for_bpw(t, Format(4, 32).bits_per_weight()))
    assert alloc.choice["x"].fmt != Format(4, 32)


def test_bf16_is_an_option_and_pins_count():
    t = table(SENS)
    alloc = allocate(t, budget_for_bpw(t, 16.0))
    assert all(o.fmt.bits == 16 or o.kld == 0 for o in alloc.choice.values())
    pinned = allocate(t, budget_for_bpw(t, 5.0), fixed={"a.out_proj": Format(16)})
    assert pinned.choice["a.out_proj"].fmt.bits == 16
    assert pinned.nbytes <= budget_for_bpw(t, 5.0)


def test_impossible_budget_is_a_clear_error():
    t = table(SENS)
    with pytest.raises(ValueError, match="below the smallest possible size"):
        allocate(t, budget_for_bpw(t, 1.0))
