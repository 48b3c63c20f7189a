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
    # the staged curriculum end to end: one step of the catalogue, then the tool space, the
    # last step on rows twice as long
    for item in TOY + ["pre_mix=catalogue", "pre_mix_steps=1", "mix=toolspace", "long_steps=1",
                       "long_seq_len=512", "tokenizer_mix=catalogue"]:
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
    assert info["steps"] == 3 and info["train_minutes"] >= 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["hidden_size"] == 128

    from mlx_lm import generate, load

    model, tok = load(str(out))
    assert isinstance(generate(model, tok, "Hello", max_tokens=4), str)


def test_staged_curriculum_schedule():
    from mixbit.models.training import corpus
    from mixbit.models.training.train import TrainConfig, phase

    cfg = TrainConfig(steps=100, pre_mix="catalogue", pre_mix_steps=40, mix="toolspace",
                      warmup_mix_frac=0.1, long_steps=20, long_seq_len=2048)
    assert phase(cfg, 0) == (corpus.WARMUP_MIX, 1025, 4)
    assert phase(cfg, 10) == (corpus.MIX, 1025, 4)
    assert phase(cfg, 40) == (corpus.TOOLSPACE_MIX, 1025, 4)
    assert phase(cfg, 80) == (corpus.TOOLSPACE_MIX, 2049, 2)  # the same tokens per step
    with pytest.raises(SystemExit, match="one of"):
        phase(TrainConfig(pre_mix="nope", pre_mix_steps=5), 0)


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


def test_compiled_training_step_survives_the_row_width_change(tmp_path):
    """A staged run's last `long_steps` use wider rows: the compiled forward and backward see a
    second shape mid-run (a 3,000-step run died at step 2,600 when Inductor compiled it as a
    dynamic shape), and still compute the eager model's loss and gradients."""
    import torch

    from mixbit.models.training.train import TrainConfig, build_model, ensure_tokenizer, forward_loss

    cfg = TrainConfig(work_dir=str(tmp_path / "work"))
    for item in TOY:
        key, _, value = item.partition("=")
        setattr(cfg, key, type(getattr(cfg, key))(value))
    cfg.compile = True
    tok = ensure_tokenizer(cfg, tmp_path / "work")
    model, _ = build_model(cfg, tok)
    fwd = forward_loss(cfg, model)
    for shape in ((4, 64), (2, 128), (4, 64)):
        x = torch.randint(0, cfg.vocab_size, shape)
        model.zero_grad()
        fwd(x).logsumexp(-1).mean().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        loss = model(input_ids=x).logits.float().logsumexp(-1).mean()
        loss.backward()
        for g, p in zip(got, model.parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-3, atol=1e-5)


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


def test_a_second_stage_starts_from_a_written_model(tmp_path):
    """init_from loads a folder train-tiny wrote (weights and tokenizer): at learning rate 0 the
    second stage writes back exactly the weights it started from; another shape is refused."""
    import torch
    from safetensors.torch import load_file

    first = ["train-tiny", "--out", str(tmp_path / "one"), "--work-dir", str(tmp_path / "w1")]
    for item in TOY:
        first += ["--train", item]
    assert run_cli(*first).returncode == 0
    second = ["train-tiny", "--out", str(tmp_path / "two"), "--work-dir", str(tmp_path / "w2")]
    for item in TOY + ["steps=1", "lr=0", "weight_decay=0", "mix=toolspace",
                       f"init_from={tmp_path / 'one'}"]:
        second += ["--train", item]
    r = run_cli(*second)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "starting from the weights of" in r.stdout + r.stderr
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoTokenizer

    one, two = (AutoTokenizer.from_pretrained(str(tmp_path / d)) for d in ("one", "two"))
    text = 'Call get_weather({"city": "Oslo"}) <|im_start|>assistant\nZuvaleth 42.5'
    assert one.get_vocab() == two.get_vocab() and one.encode(text) == two.encode(text)
    assert one.chat_template == two.chat_template
    wider = [x.replace("hidden_size=128", "hidden_size=256") for x in second]
    r = run_cli(*[str(tmp_path / "w3") if x == str(tmp_path / "w2") else x for x in wider])
    assert r.returncode != 0 and "another shape (hidden_size" in r.stderr
