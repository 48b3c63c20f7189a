"""`mixbit train-tiny` end to end on a toy size: trains, resumes, exports a loadable checkpoint."""

import json

import pytest

from .conftest import run_cli

pytest.importorskip("torch")

TOY = ["steps=3", "tokenizer_docs=300", "vocab_size=600", "hidden_size=128", "intermediate_size=256",
       "num_hidden_layers=2", "seq_len=256", "batch_rows=2", "checkpoint_every=1", "warmup_steps=1",
       "num_attention_heads=2", "num_key_value_heads=1", "linear_num_value_heads=2",
       "linear_num_key_heads=1", "compile=false", "precision=fp32"]


def test_train_resume_export(tmp_path):
    args = ["train-tiny", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    for item in TOY:
        args += ["--train", item]
    first = run_cli(*args, "--max-minutes", "0")  # stops (resumably) right after its first step
    assert first.returncode == 0, first.stderr[-2000:]
    assert "run again to resume" in first.stdout + first.stderr
    assert not (tmp_path / "out").exists()
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming at step 1" in second.stdout + second.stderr
    out = tmp_path / "out"
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 3
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["hidden_size"] == 128

    from mlx_lm import generate, load

    model, tok = load(str(out))
    assert isinstance(generate(model, tok, "Hello", max_tokens=4), str)


def test_changed_settings_do_not_resume_silently(tmp_path):
    args = ["train-tiny", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    for item in TOY:
        args += ["--train", item]
    assert run_cli(*args, "--max-minutes", "0").returncode == 0
    changed = run_cli(*args, "--train", "lr=0.01")
    assert changed.returncode != 0
    assert "made with other settings" in changed.stderr


def test_compiled_bfloat16_training_forward_matches_eager_float32(tmp_path):
    """What train-tiny runs by default (torch.compile, bfloat16 autocast where the CPU has it)
    computes the model's logits: the same as the eager float32 forward to bfloat16 rounding."""
    import torch

    from mixbit.models.training.train import TrainConfig, build_model, ensure_tokenizer, forward_loss

    cfg = TrainConfig(work_dir=str(tmp_path / "work"))
    for item in TOY:
        key, _, value = item.partition("=")
        if key not in ("compile", "precision"):
            setattr(cfg, key, type(getattr(cfg, key))(value))
    tok = ensure_tokenizer(cfg, tmp_path / "work")
    model, _ = build_model(cfg, tok)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        eager = model(input_ids=x).logits.float()
    for precision, tol in (("fp32", 1e-4), ("bf16", 0.1)):
        cfg.precision, cfg.compile = precision, True
        with torch.no_grad():
            got = forward_loss(cfg, model)(x)
        err = (got - eager).abs().max().item() / eager.abs().max().item()
        assert err < tol, (precision, err)


def test_throughput_times_steps_and_trains_nothing(tmp_path):
    args = ["train-tiny", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
            "--throughput", "2"]
    for item in TOY:
        args += ["--train", item]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["tok_per_s"] > 0 and report["precision"] == "fp32" and report["compiled"] is False
    assert not (tmp_path / "out").exists() and not (tmp_path / "work" / "checkpoint.pt").exists()
