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


def test_eval_variants_with_the_agent_soak_through_the_served_api(tmp_path):
    """`mixbit eval --variants V --soak N`: every variant is served by `mixbit serve` and driven
    through /v1/messages with and without the tool grammar; the table and the JSON say where
    each loop broke."""
    out = tmp_path / "soak.json"
    r = run_cli("eval", "--variants", "uniform-4", "--n-tool", "2", "--n-docs", "8", "--soak", "2", "--out", str(out),
                "--set", f"model.cache_dir='{tmp_path / 'cache'}'", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"bf16", "uniform-4"}
    for row in rows.values():
        assert set(row["soak"]) == {"free", "grammar"}
        for s in row["soak"].values():
            assert 0 <= s["rounds"] <= 2 and s["tokens"] > 0 and s["played"] == 2
            # a loop either ran its 2 rounds clean or names the first round that broke and why,
            # and counts the rounds that broke (it goes on after a break)
            assert (s["rounds"], s["broke_at"], s["failed"]) == (2, None, 0) or (
                s["broke_at"] == s["rounds"] + 1 and s["reason"] and 1 <= s["failed"] <= 2)
    assert rows["bf16"]["soak"]["grammar"]["rounds"] == 2  # the trained model holds 7 rounds
    header = next(line for line in r.stdout.splitlines() if line.startswith("| variant"))
    assert "agent soak via /v1/messages" in header
    assert "soak (grammar)" in r.stdout  # progress names each loop as it ends
