"""`mixbit quantize` and the comparison table, as a user runs them."""

import json

from mixbit.quant.compare import VariantResult, pareto, table

from .conftest import run_cli


def test_quantize_into_a_new_folder(tmp_path):
    out = tmp_path / "tiny-u4"
    r = run_cli("quantize", "--recipe", "uniform-4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["path"] == str(out) and abs(info["bits_per_weight"] - 4.5) < 1e-6
    assert (out / "recipe.json").is_file() and (out / "checksums.json").is_file()
    again = run_cli("quantize", "--recipe", "uniform-4", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr
    bad = run_cli("quantize", "--recipe", "bf16")
    assert bad.returncode == 2 and "does not quantize" in bad.stderr


def test_unknown_recipe_is_a_clear_error():
    r = run_cli("quantize", "--recipe", "magic-2")
    assert r.returncode == 2 and "quant.recipe" in r.stderr and "mixbit-auto" in r.stderr


def _result(name, nbytes, kld):
    return VariantResult(name=name, path="/x", nbytes=nbytes, bits_per_weight=4.0, kld_mean=kld,
                         kld_p99=kld * 5, top1=0.9, ppl={"tool": 1.5},
                         tools={"well_formed": 1.0, "right_function": 0.9, "exact_args": 0.5,
                                "plain_answer": 0.8})


def test_pareto_front_and_table():
    rs = [_result("a", 100, 0.10), _result("b", 120, 0.05), _result("c", 130, 0.08), _result("d", 90, 0.3)]
    assert [r.name for r in pareto(rs)] == ["d", "a", "b"]
    text = table(rs)
    assert text.splitlines()[0].startswith("| variant | MB | bpw | KLD mean")
    assert len(text.splitlines()) == 2 + len(rs)
