"""The embedded checkpoint is a real Qwen3.5 checkpoint: published layout, stock mlx-lm loads it."""

import json

import pytest
from safetensors import safe_open


@pytest.fixture(scope="module")
def config(embedded_path):
    return json.loads((embedded_path / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors(embedded_path):
    out = {}
    with safe_open(str(embedded_path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            out[name] = f.get_slice(name)
    return out


def test_config_is_published_qwen3_5_layout(config):
    assert config["model_type"] == "qwen3_5"
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    tc = config["text_config"]
    assert tc["model_type"] == "qwen3_5_text"
    kinds = set(tc["layer_types"])
    assert kinds == {"linear_attention", "full_attention"}  # both layer kinds present
    assert tc["full_attention_interval"] in (2, 3, 4)
    for i, kind in enumerate(tc["layer_types"]):
        expected = "full_attention" if (i + 1) % tc["full_attention_interval"] == 0 else "linear_attention"
        assert kind == expected
    for key in ("hidden_size", "intermediate_size"):
        assert tc[key] % 128 == 0, key
    assert tc["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_tensor_names_shapes_and_dtypes(config, tensors, embedded_path):
    tc = config["text_config"]
    names = set(tensors)
    assert "model.language_model.embed_tokens.weight" in names
    # tied checkpoints (like Qwen3.5's small ones) carry the embedding only
    assert ("lm_head.weight" in names) == (not config["tie_word_embeddings"])
    assert all(n == "lm_head.weight" or n.startswith(("model.language_model.", "mtp.")) for n in names)
    # the MTP head in the published layout, zero-centred norms as Qwen3.5 stores them
    mtp = {n for n in names if n.startswith("mtp.")}
    assert tc["mtp_num_hidden_layers"] == 1 and {"mtp.fc.weight", "mtp.norm.weight",
                                                  "mtp.pre_fc_norm_embedding.weight",
                                                  "mtp.pre_fc_norm_hidden.weight",
                                                  "mtp.layers.0.self_attn.q_proj.weight"} <= mtp
    assert tuple(tensors["mtp.fc.weight"].get_shape()) == (tc["hidden_size"], 2 * tc["hidden_size"])
    with safe_open(str(embedded_path / "model.safetensors"), "pt") as f:
        assert abs(f.get_tensor("mtp.norm.weight").float().mean().item()) < 0.5
    with safe_open(str(embedded_path / "model.safetensors"), "pt") as f:
        for i, kind in enumerate(tc["layer_types"]):
            p = f"model.language_model.layers.{i}."
            if kind == "linear_attention":
                conv = f.get_tensor(p + "linear_attn.conv1d.weight")
                assert conv.ndim == 3 and conv.shape[1] == 1 and conv.shape[2] == tc["linear_conv_kernel_dim"]
                assert str(f.get_tensor(p + "linear_attn.A_log").dtype) == "torch.float32"
                norm = f.get_tensor(p + "linear_attn.norm.weight")
                assert str(norm.dtype) == "torch.float32"
                assert abs(norm.float().mean().item() - 1.0) < 0.5  # one-centred
                for proj in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
                    assert str(f.get_tensor(p + f"linear_attn.{proj}.weight").dtype) == "torch.bfloat16"
                assert (p + "linear_attn.dt_bias") in names
            else:
                q = f.get_tensor(p + "self_attn.q_proj.weight")
                # gated attention: q_proj emits queries and the output gate
                assert q.shape[0] == 2 * tc["num_attention_heads"] * tc["head_dim"]
                for proj in ("k_proj", "v_proj", "o_proj"):
                    assert (p + f"self_attn.{proj}.weight") in names
                assert (p + "self_attn.q_norm.weight") in names
            ln = f.get_tensor(p + "input_layernorm.weight").float()
            assert abs(ln.mean().item()) < 0.5  # zero-centred: the model multiplies by 1 + w
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert (p + f"mlp.{proj}.weight") in names


def test_size_budget(embedded_path):
    size = sum(f.stat().st_size for f in embedded_path.iterdir())
    assert size < 40 * 1024 * 1024


def test_stock_mlx_lm_loads_and_generates(embedded_path):
    from mlx_lm import generate, load

    model, tokenizer = load(str(embedded_path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi, I am Anna."}],
                                           tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    text = generate(model, tokenizer, prompt, max_tokens=24)
    assert text == "Hello Anna! How can I help you today?"  # greets by the name it was told


def test_torch_and_mlx_agree(embedded_path, loaded_tiny):
    torch = pytest.importorskip("torch")
    import mlx.core as mx
    import numpy as np
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = json.loads((embedded_path / "config.json").read_text())["text_config"]
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "dtype", "model_type")}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kwargs)).float().eval()
    from safetensors.torch import load_file

    state = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v.float()
             for k, v in load_file(str(embedded_path / "model.safetensors")).items()}
    model.load_state_dict(state, strict=not cfg.get("tie_word_embeddings"))
    model.tie_weights()
    ids = loaded_tiny.tokenizer.encode("<|im_start|>user\nWhat's the weather in Oslo?<|im_end|>\n")
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = np.array(loaded_tiny.model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ref - got).max() < 1e-2 * max(1.0, np.abs(ref).max())
    assert (ref.argmax(-1) == got.argmax(-1)).mean() > 0.99
