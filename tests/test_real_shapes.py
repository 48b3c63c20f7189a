"""tests/bench/real_shapes.py writes random-weight checkpoints in Qwen3.5's published layout.

Only the tiny shapes are written here (a fraction of a second each); the real shapes are checked
as specifications (names and shapes against transformers' own models, built on the meta device).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent / "bench" / "real_shapes.py"
_spec = importlib.util.spec_from_file_location("real_shapes", _PATH)
rs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("real_shapes", rs)  # dataclasses look their module up
_spec.loader.exec_module(rs)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def written(request, tmp_path_factory):
    path = rs.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0)
    return request.param, path


def test_layout_index_and_files(written):
    name, path = written
    config = json.loads((path / "config.json").read_text())
    tc = config["text_config"]
    moe = name == "tiny-moe"
    assert config["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    assert tc["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert "vision_config" in config and (path / "generation_config.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / f).is_file()

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model*.safetensors"))
    assert [p.name for p in shards] == list(rs.SHARD_NAMES)  # two shards
    headers = {p.name: _header(p) for p in shards}
    on_disk = {k: p for p, h in headers.items() for k in h}
    assert index["weight_map"] == on_disk  # the index lists every tensor, in the right file
    sizes = [m["data_offsets"][1] - m["data_offsets"][0] for h in headers.values() for m in h.values()]
    assert index["metadata"]["total_size"] == sum(sizes)
    for p, h in headers.items():  # each file is exactly its header plus its data
        n = struct.unpack("<Q", (path / p).read_bytes()[:8])[0]
        assert (path / p).stat().st_size == 8 + n + max(m["data_offsets"][1] for m in h.values())

    meta = {k: m for h in headers.values() for k, m in h.items()}
    keys = set(meta)
    assert any(k.startswith("model.visual.blocks.") for k in keys)
    assert {"model.visual.patch_embed.proj.weight", "model.visual.merger.linear_fc2.weight"} <= keys
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= keys
    assert ("lm_head.weight" in keys) == (not tc["tie_word_embeddings"])
    assert all(k.startswith(("model.language_model.", "model.visual.", "mtp.", "lm_head."))
               for k in keys)
    for k, m in meta.items():
        f32 = k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))
        assert m["dtype"] == ("F32" if f32 else "BF16"), k
    conv = meta["model.language_model.layers.0.linear_attn.conv1d.weight"]["shape"]
    assert conv[1] == 1 and conv[2] == tc["linear_conv_kernel_dim"]
    H = tc["hidden_size"]
    assert meta["mtp.fc.weight"]["shape"] == [H, 2 * H]
    if moe:
        E, inter = tc["num_experts"], tc["moe_intermediate_size"]
        p = "model.language_model.layers.0.mlp."
        assert meta[p + "experts.gate_up_proj"]["shape"] == [E, 2 * inter, H]
        assert meta[p + "experts.down_proj"]["shape"] == [E, H, inter]
        assert meta[p + "gate.weight"]["shape"] == [E, H]
        assert meta[p + "shared_expert_gate.weight"]["shape"] == [1, H]
        assert p + "shared_expert.down_proj.weight" in keys
        # the MTP layer's experts are per expert (as in Qwen3.5-35B-A3B)
        assert meta[f"mtp.layers.0.mlp.experts.{E - 1}.down_proj.weight"]["shape"] == [H, inter]


def test_norm_conventions(written):
    import mlx.core as mx

    _, path = written
    w = {}
    for p in sorted(path.glob("model*.safetensors")):
        w.update(mx.load(str(p)))
    zero = [k for k in w if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight",
                                        "language_model.norm.weight", "mtp.norm.weight",
                                        "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"))]
    one = [k for k in w if k.endswith("linear_attn.norm.weight")]
    assert zero and one
    for k in zero:  # zero-centred: the model multiplies by 1 + w
        assert abs(w[k].astype(mx.float32).mean().item()) < 0.05, k
    for k in one:
        assert abs(w[k].mean().item() - 1.0) < 0.05, k
    emb = w["model.language_model.embed_tokens.weight"].astype(mx.float32)
    assert 0.015 < mx.std(emb).item() < 0.025


def test_stock_mlx_lm_loads_and_runs(written):
    import mlx.core as mx

    _, path = written
    logits = rs.smoke_forward(path, n_tokens=6)
    assert logits.shape == (1, 6, 4096)
    assert mx.all(mx.isfinite(logits)).item()


def test_seeded(tmp_path):
    a = rs.write_checkpoint("tiny", tmp_path / "a", seed=1)
    b = rs.write_checkpoint("tiny", tmp_path / "b", seed=1)
    c = rs.write_checkpoint("tiny", tmp_path / "c", seed=2)
    shard = rs.SHARD_NAMES[0]
    assert (a / shard).read_bytes() == (b / shard).read_bytes() != (c / shard).read_bytes()


def test_every_shape_matches_transformers_names_and_shapes():
    """All shapes (real ones too, without writing them): the tensors written are exactly the
    parameters of transformers' Qwen3_5[Moe]ForConditionalGeneration for that config (mtp.* aside:
    transformers does not model the MTP head)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForImageTextToText

    for name in rs.SHAPES:
        config = rs.build_config(name)
        specs = {t.name: t.shape for t in rs.tensor_specs(config) if not t.name.startswith("mtp.")}
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
        got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if config["tie_word_embeddings"]:
            got.pop("lm_head.weight", None)
        assert got == specs, name


def test_real_shapes():
    sizes = {name: sum(t.numel for t in rs.tensor_specs(rs.build_config(name))) for name in rs.SHAPES}
    assert 0.7e9 < sizes["0.8b"] < 0.9e9 and 1.8e9 < sizes["2b"] < 2.1e9
    assert 4.0e9 < sizes["4b"] < 4.6e9
    tc = rs.text_config("0.8b")
    assert (tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"]) == (24, 1024, 248320)
    assert tc["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    moe = rs.build_config("35b-a3b-reduced")
    assert moe["model_type"] == "qwen3_5_moe" and moe["text_config"]["num_experts"] == 16
    assert "intermediate_size" not in moe["text_config"]
    # the MTP head of the 2B shape as Qwen/Qwen3.5-2B publishes it
    mtp = {t.name: t.shape for t in rs.tensor_specs(rs.build_config("2b")) if t.name.startswith("mtp.")}
    assert mtp["mtp.fc.weight"] == (2048, 4096)
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert mtp["mtp.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert mtp["mtp.layers.0.mlp.down_proj.weight"] == (2048, 6144)
    assert len(mtp) == 15
