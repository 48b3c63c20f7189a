"""Random-weight Qwen3.5 checkpoints at real shapes, in the published Hugging Face layout, for benchmarks.

Time and memory benchmarks need Qwen3.5's real widths, not its trained weights. This writes a
checkpoint folder that looks like a published one (config.json with text_config + vision_config,
two safetensors shards + model.safetensors.index.json, `model.language_model.*`, `model.visual.*`
and `mtp.*` tensors, published dtypes and norm conventions, tokenizer, chat template) filled with
seeded random numbers. Quality is meaningless; shapes, names, dtypes and byte counts are real.

    .venv/bin/python tests/bench/real_shapes.py --list
    .venv/bin/python tests/bench/real_shapes.py 0.8b /tmp/q08 [--seed 0] [--check]

    from real_shapes import write_checkpoint
    path = write_checkpoint("2b", "/tmp/q2b", seed=0)

Tensors are generated and written one chunk (at most 4M values) at a time straight into the shard
files, so peak memory stays around 100 MB whatever the shape (the 2B shape is 4 GB of bf16).

Conventions (what the published checkpoints carry, and what mlx-lm's qwen3_5 / qwen3_5_moe
`sanitize` and transformers' Qwen3.5 / Qwen3.5-MoE modeling code expect):
  * bf16 everywhere except `linear_attn.A_log` and `linear_attn.norm.weight` (float32);
  * RMSNorm weights zero-centred (the model multiplies by 1 + w): input/post-attention layernorms,
    final norm, q_norm/k_norm, mtp norms; `linear_attn.norm` one-centred (a plain gated RMSNorm);
  * `linear_attn.conv1d.weight` shaped [conv_dim, 1, kernel] (mlx-lm's sanitize moves the axis and,
    seeing that unsanitized shape, adds 1 to the zero-centred norms);
  * full attention `q_proj` has 2 x heads x head_dim rows (query + output gate, attn_output_gate);
  * MoE decoder layers (Qwen3.5-35B-A3B): `mlp.gate.weight` [E, H] router, routed experts FUSED as
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows) and `mlp.experts.down_proj`
    [E, H, I] (no `.weight` suffix; the only expert form mlx-lm's qwen3_5_moe sanitize accepts),
    `mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight` [1, H];
  * MTP head (`mtp_num_hidden_layers` 1): `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm`, and `mtp.layers.0.*`, one full-attention decoder layer;
    for MoE its experts are PER-EXPERT `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`,
    as in Qwen3.5-35B-A3B (Qwen3.6 fused them); mlx-lm and transformers drop `mtp.*` on load;
  * vision tower `model.visual.*` is a small stand-in (2 blocks, width 64) matching the small
    vision_config written next to it; mlx-lm drops it on load.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "models" / "tiny-qwen3.5"
CHAT_TEMPLATE = ROOT / "models" / "chat" / "chat_template.jinja"
QWEN_VOCAB = 248320  # Qwen3.5's embedding rows; shapes with another vocab use the embedded tokenizer
CHUNK = 1 << 22  # values generated per step


def layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# Qwen/Qwen3.5-0.8B's published text_config, every key; SHAPES override it.
BASE_TEXT = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": None,
    "dtype": "bfloat16",
    "eos_token_id": 248046,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3584,
    "layer_types": layer_types(24, 4),
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 8,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],  # head_dim 256 x 0.25 rotary = 64 dims = 32 pairs
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": QWEN_VOCAB,
}

# Keys a qwen3_5_moe_text config has in place of intermediate_size (transformers' defaults =
# Qwen3.5-35B-A3B's published values).
MOE_TEXT = {
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
}

_TINY = {
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "max_position_embeddings": 4096, "vocab_size": 4096, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [4, 2, 2],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                        "rope_type": "default"},
}

# name -> text_config overrides of BASE_TEXT (layer_types follow num_hidden_layers and
# full_attention_interval unless given).
SHAPES: dict[str, dict] = {
    # Qwen3.5-0.8B exactly.
    "0.8b": {},
    # Qwen3.5-2B: same heads and layer pattern, wider.
    "2b": {"hidden_size": 2048, "intermediate_size": 6144},
    # Qwen3.5-4B: 32 layers, 16 query / 4 KV heads of 256, 16 key / 32 value GatedDeltaNet heads
    # of 128, tied embeddings. Hidden/intermediate/layer pattern/head_dim checked against a
    # published Qwen3.5-4B-derived config.json and a model card quoting Qwen/Qwen3.5-4B (hidden
    # 2560, 32 layers, GQA 16Q/4KV, head_dim 256, vocab 248320); the GatedDeltaNet head counts
    # (16/32) are the brief's values and those of the 9B/35B-A3B, not seen in a 4B config here.
    "4b": {"hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
           "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32},
    # Qwen3.5-35B-A3B's real widths and heads (published config: hidden 2048, 16 Q / 2 KV heads of
    # 256, 16 key / 32 value GatedDeltaNet heads of 128, experts of 512, shared expert 512,
    # top-8, untied embeddings), reduced to 8 layers (3:1 pattern kept) and 16 experts.
    "35b-a3b-reduced": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                        "num_hidden_layers": 8, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "linear_num_value_heads": 32,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "num_experts": 16, "num_experts_per_tok": 8,
                        "tie_word_embeddings": False},
    # The sizes people run, at full width and reduced in depth only (3:1 layer pattern kept, the
    # MTP layer, the vision stand-in and the 248k vocabulary as published): quantizing them
    # measures time per layer and whether memory grows with depth (sizes_bench.py). Values from
    # the published config.json files (Qwen/Qwen3.5-9B verbatim through an MLX conversion of it;
    # Qwen/Qwen3.5-27B as transcribed from its config.json and Qwen's Megatron arguments;
    # Qwen/Qwen3.5-35B-A3B from transformers' dump of its config), full depths 32, 64 and 40.
    **{f"9b-{n}l": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": n,
                    "num_attention_heads": 16, "num_key_value_heads": 4,
                    "linear_num_value_heads": 32, "tie_word_embeddings": False,
                    "eos_token_id": 248044} for n in (4, 8)},
    "9b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
           "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32,
           "tie_word_embeddings": False, "eos_token_id": 248044},
    **{f"27b-{n}l": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": n,
                     "num_attention_heads": 24, "num_key_value_heads": 4,
                     "linear_num_value_heads": 48, "tie_word_embeddings": False,
                     "eos_token_id": 248044} for n in (4, 8)},
    **{f"35b-a3b-{n}l": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                         "num_hidden_layers": n, "num_attention_heads": 16,
                         "num_key_value_heads": 2, "linear_num_value_heads": 32,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                         "num_experts": 256, "num_experts_per_tok": 8,
                         "tie_word_embeddings": False, "eos_token_id": 248044} for n in (4, 8)},
    # Same structures, tiny, with the embedded model's 4,096-token tokenizer: for fast tests.
    "tiny": dict(_TINY),
    # Wider than tiny, at 4 and 8 layers: a test that quantizing's memory does not grow with depth.
    **{f"tiny-wide-{n}l": {**_TINY, "hidden_size": 1024, "intermediate_size": 3072,
                           "num_hidden_layers": n} for n in (4, 8)},
    "tiny-moe": {**{k: v for k, v in _TINY.items() if k != "intermediate_size"},
                 "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 64,
                 "shared_expert_intermediate_size": 64, "num_experts": 4,
                 "num_experts_per_tok": 2, "tie_word_embeddings": False},
}


def text_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    over = SHAPES[shape]
    tc = json.loads(json.dumps(BASE_TEXT))
    if over.get("model_type") == "qwen3_5_moe_text":
        del tc["intermediate_size"]
        tc.update(MOE_TEXT)
    tc.update(json.loads(json.dumps(over)))
    if "layer_types" not in over:
        tc["layer_types"] = layer_types(tc["num_hidden_layers"], tc["full_attention_interval"])
    assert len(tc["layer_types"]) == tc["num_hidden_layers"]
    return dict(sorted(tc.items()))


def vision_config(text: dict, moe: bool) -> dict:
    """A small vision tower (published keys, stand-in widths): its tensors are written too."""
    return {
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "num_heads": 4,
        "num_position_embeddings": 64,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def build_config(shape: str) -> dict:
    tc = text_config(shape)
    moe = tc["model_type"] == "qwen3_5_moe_text"
    try:
        from importlib.metadata import version
        tf_version = version("transformers")
    except Exception:  # pragma: no cover
        tf_version = "5.0.0"
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": tc,
        "tie_word_embeddings": tc["tie_word_embeddings"],
        "transformers_version": tf_version,
        "vision_config": vision_config(tc, moe),
    }
    if tc["vocab_size"] == QWEN_VOCAB:  # Qwen3.5's multimodal token ids (the tiny vocab has none)
        cfg.update({"image_token_id": 248056, "video_token_id": 248057,
                    "vision_start_token_id": 248053, "vision_end_token_id": 248054})
    return dict(sorted(cfg.items()))


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "BF16"  # or "F32"
    init: str = "normal"  # normal | norm0 | norm1 | bias | A_log | dt_bias
    std: float = 0.02

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (4 if self.dtype == "F32" else 2)


def _mlp(p: str, tc: dict, moe: bool, fused: bool) -> list[Tensor]:
    H = tc["hidden_size"]
    if not moe:
        inter = tc["intermediate_size"]
        return [Tensor(p + "mlp.gate_proj.weight", (inter, H)),
                Tensor(p + "mlp.up_proj.weight", (inter, H)),
                Tensor(p + "mlp.down_proj.weight", (H, inter))]
    E, inter, S = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    out = [Tensor(p + "mlp.gate.weight", (E, H))]
    if fused:
        out += [Tensor(p + "mlp.experts.gate_up_proj", (E, 2 * inter, H)),
                Tensor(p + "mlp.experts.down_proj", (E, H, inter))]
    else:
        for e in range(E):
            out += [Tensor(p + f"mlp.experts.{e}.gate_proj.weight", (inter, H)),
                    Tensor(p + f"mlp.experts.{e}.up_proj.weight", (inter, H)),
                    Tensor(p + f"mlp.experts.{e}.down_proj.weight", (H, inter))]
    out += [Tensor(p + "mlp.shared_expert.gate_proj.weight", (S, H)),
            Tensor(p + "mlp.shared_expert.up_proj.weight", (S, H)),
            Tensor(p + "mlp.shared_expert.down_proj.weight", (H, S)),
            Tensor(p + "mlp.shared_expert_gate.weight", (1, H))]
    return out


def _decoder_layer(p: str, tc: dict, linear: bool, moe: bool, fused: bool) -> list[Tensor]:
    H = tc["hidden_size"]
    out = [Tensor(p + "input_layernorm.weight", (H,), init="norm0")]
    if linear:
        nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        kd, vd = nk * dk, nv * dv
        a = p + "linear_attn."
        out += [Tensor(a + "A_log", (nv,), "F32", "A_log"),
                Tensor(a + "conv1d.weight", (2 * kd + vd, 1, tc["linear_conv_kernel_dim"]), std=0.1),
                Tensor(a + "dt_bias", (nv,), init="dt_bias"),
                Tensor(a + "in_proj_a.weight", (nv, H)),
                Tensor(a + "in_proj_b.weight", (nv, H)),
                Tensor(a + "in_proj_qkv.weight", (2 * kd + vd, H)),
                Tensor(a + "in_proj_z.weight", (vd, H)),
                Tensor(a + "norm.weight", (dv,), "F32", "norm1"),
                Tensor(a + "out_proj.weight", (H, vd))]
    else:
        nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        gate = 2 if tc.get("attn_output_gate", True) else 1
        a = p + "self_attn."
        out += [Tensor(a + "k_norm.weight", (hd,), init="norm0"),
                Tensor(a + "k_proj.weight", (nkv * hd, H)),
                Tensor(a + "o_proj.weight", (H, nh * hd)),
                Tensor(a + "q_norm.weight", (hd,), init="norm0"),
                Tensor(a + "q_proj.weight", (gate * nh * hd, H)),
                Tensor(a + "v_proj.weight", (nkv * hd, H))]
    out += _mlp(p, tc, moe, fused)
    out.append(Tensor(p + "post_attention_layernorm.weight", (H,), init="norm0"))
    return out


def _visual(vc: dict) -> list[Tensor]:
    p, D, F = "model.visual.", vc["hidden_size"], vc["intermediate_size"]
    M = D * vc["spatial_merge_size"] ** 2

    def linear(name, rows, cols):
        return [Tensor(name + ".weight", (rows, cols)), Tensor(name + ".bias", (rows,), init="bias")]

    def layernorm(name, dim):
        return [Tensor(name + ".weight", (dim,), init="norm1"),
                Tensor(name + ".bias", (dim,), init="bias")]

    out = [Tensor(p + "patch_embed.proj.weight", (D, vc["in_channels"], vc["temporal_patch_size"],
                                                   vc["patch_size"], vc["patch_size"])),
           Tensor(p + "patch_embed.proj.bias", (D,), init="bias"),
           Tensor(p + "pos_embed.weight", (vc["num_position_embeddings"], D))]
    for b in range(vc["depth"]):
        q = f"{p}blocks.{b}."
        out += layernorm(q + "norm1", D) + layernorm(q + "norm2", D)
        out += linear(q + "attn.qkv", 3 * D, D) + linear(q + "attn.proj", D, D)
        out += linear(q + "mlp.linear_fc1", F, D) + linear(q + "mlp.linear_fc2", D, F)
    out += layernorm(p + "merger.norm", D)
    out += linear(p + "merger.linear_fc1", M, M) + linear(p + "merger.linear_fc2", vc["out_hidden_size"], M)
    return out


def tensor_specs(config: dict) -> list[Tensor]:
    """Every tensor of the checkpoint, in model order (embeddings, layers, norm, head, mtp, visual)."""
    tc = config["text_config"]
    moe = tc["model_type"] == "qwen3_5_moe_text"
    H, V = tc["hidden_size"], tc["vocab_size"]
    p = "model.language_model."
    out = [Tensor(p + "embed_tokens.weight", (V, H))]
    for i, kind in enumerate(tc["layer_types"]):
        out += _decoder_layer(f"{p}layers.{i}.", tc, kind == "linear_attention", moe, fused=True)
    out.append(Tensor(p + "norm.weight", (H,), init="norm0"))
    if not tc["tie_word_embeddings"]:
        out.append(Tensor("lm_head.weight", (V, H)))
    n_mtp = tc.get("mtp_num_hidden_layers", 0)
    if n_mtp:
        out += [Tensor("mtp.fc.weight", (H, 2 * H)),
                Tensor("mtp.pre_fc_norm_embedding.weight", (H,), init="norm0"),
                Tensor("mtp.pre_fc_norm_hidden.weight", (H,), init="norm0")]
        for j in range(n_mtp):
            out += _decoder_layer(f"mtp.layers.{j}.", tc, False, moe, fused=False)
        out.append(Tensor("mtp.norm.weight", (H,), init="norm0"))
    out += _visual(config["vision_config"])
    names = [t.name for t in out]
    assert len(names) == len(set(names)), "duplicate tensor names"
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def _values(t: Tensor, rng: np.random.Generator, n: int) -> np.ndarray:
    """n float32 values of tensor t's distribution."""
    if t.init == "A_log":  # log of decay rates in [1, 16), as the modeling code initializes
        return np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    if t.init == "normal":
        x *= np.float32(t.std)
    elif t.init in ("norm0", "bias"):  # zero-centred norm (1 + w) / bias: small around 0
        x *= np.float32(0.01)
    elif t.init == "norm1":  # one-centred norm weight
        x *= np.float32(0.01)
        x += np.float32(1.0)
    elif t.init == "dt_bias":
        x *= np.float32(0.1)
        x += np.float32(1.0)
    else:
        raise ValueError(t.init)
    return x


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; x is consumed."""
    u = x.view(np.uint32)
    u += ((u >> 16) & 1) + np.uint32(0x7FFF)
    return (u >> 16).astype(np.uint16)


def _write_tensor(f, t: Tensor, seed: int) -> int:
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    row = math.prod(t.shape[1:]) if len(t.shape) > 1 else 1
    rows = t.shape[0]
    step = max(1, CHUNK // row)
    written = 0
    for r0 in range(0, rows, step):
        x = _values(t, rng, min(step, rows - r0) * row)
        buf = x if t.dtype == "F32" else _bf16(x)
        f.write(memoryview(np.ascontiguousarray(buf)).cast("B"))
        written += buf.nbytes
        del x, buf
    return written


def _write_shard(path: Path, tensors: list[Tensor], seed: int) -> None:
    """A safetensors file written tensor by tensor: the header first (all sizes are known), then
    each tensor's bytes generated chunk by chunk."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors:
            n = _write_tensor(f, t, seed)
            assert n == t.nbytes, (t.name, n, t.nbytes)
    tmp.replace(path)


def _special_ids(tokenizer_json: Path) -> dict[str, int]:
    """Added-token ids from a tokenizer.json, decoding only its leading `added_tokens` list."""
    with open(tokenizer_json, encoding="utf-8") as f:
        head = f.read(1 << 20)
    i = head.find('"added_tokens"')
    if i >= 0:
        try:
            tokens, _ = json.JSONDecoder().raw_decode(head, head.index("[", i))
            return {t["content"]: t["id"] for t in tokens}
        except ValueError:
            pass
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def _write_tokenizer(out: Path, config: dict) -> None:
    tc = config["text_config"]
    if tc["vocab_size"] != QWEN_VOCAB:  # tiny shapes: the embedded model's tokenizer files
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "generation_config.json"):
            shutil.copyfile(EMBEDDED / name, out / name)
        return
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from qwen_vocab import CACHE, build

    if not (CACHE / "tokenizer.json").exists():
        build()
    shutil.copyfile(CACHE / "tokenizer.json", out / "tokenizer.json")
    shutil.copyfile(CHAT_TEMPLATE, out / "chat_template.jinja")
    ids = _special_ids(out / "tokenizer.json")
    tok_cfg = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = tc["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = json.loads((EMBEDDED / "generation_config.json").read_text())
    gen["eos_token_id"] = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen["pad_token_id"] = ids["<|endoftext|>"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


SHARD_NAMES = ("model.safetensors-00001-of-00002.safetensors",
               "model.safetensors-00002-of-00002.safetensors")  # Qwen's published naming


def split_shards(tensors: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Two shards in model order, split where half the bytes are written."""
    total, acc, first = sum(t.nbytes for t in tensors), 0, []
    for t in tensors:
        if acc and acc + t.nbytes / 2 > total / 2:
            break
        first.append(t)
        acc += t.nbytes
    return first, tensors[len(first):]


def write_checkpoint(shape_name: str, out_dir, seed: int = 0) -> Path:
    """Writes a random-weight checkpoint of SHAPES[shape_name] into out_dir; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    config = build_config(shape_name)
    tensors = tensor_specs(config)
    shards = split_shards(tensors)
    weight_map = {}
    for name, group in zip(SHARD_NAMES, shards):
        _write_shard(out / name, group, seed)
        weight_map.update({t.name: name for t in group})
    index = {"metadata": {"total_parameters": sum(t.numel for t in tensors),
                          "total_size": sum(t.nbytes for t in tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(out, config)
    return out


# ---------------------------------------------------------------------------------------------
# Checks


def smoke_forward(path, n_tokens: int = 8, float32: bool = True):
    """Stock mlx_lm.load (lazy) and one forward pass; returns the logits as float32 mx.array."""
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(path), lazy=True)
    if float32:
        model.set_dtype(mx.float32)
    vocab = model.args.text_config["vocab_size"]
    ids = mx.array(np.random.default_rng(0).integers(0, min(vocab, 4096), (1, n_tokens)))
    logits = model(ids).astype(mx.float32)
    mx.eval(logits)
    return logits


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def _describe(name: str) -> str:
    cfg = build_config(name)
    tc, ts = cfg["text_config"], tensor_specs(cfg)
    kind = f"MoE {tc['num_experts']}x top-{tc['num_experts_per_tok']}" if "num_experts" in tc else "dense"
    return (f"{name:16s} {kind:14s} layers {tc['num_hidden_layers']:2d} hidden {tc['hidden_size']:5d} "
            f"vocab {tc['vocab_size']:6d} tied {str(tc['tie_word_embeddings']):5s} "
            f"{sum(t.numel for t in ts) / 1e9:6.3f} B params {sum(t.nbytes for t in ts) / 2**30:6.2f} GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", choices=list(SHAPES))
    ap.add_argument("out", nargs="?")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list the shapes and their sizes")
    ap.add_argument("--check", action="store_true",
                    help="then load it with mlx_lm.load and run a float32 forward pass")
    a = ap.parse_args(argv)
    if a.list:
        for name in SHAPES:
            print(_describe(name))
        return 0
    if not (a.shape and a.out):
        ap.error("give SHAPE and OUT, or --list")
    t0 = time.perf_counter()
    path = write_checkpoint(a.shape, a.out, seed=a.seed)
    dt = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"{_describe(a.shape)}\nwrote {path} ({size / 2**30:.2f} GiB on disk) in {dt:.1f} s, "
          f"peak RSS {_peak_rss_mb():.0f} MB")
    if a.check:
        t0 = time.perf_counter()
        logits = smoke_forward(path)
        import mlx.core as mx
        finite = bool(mx.all(mx.isfinite(logits)).item())
        print(f"mlx_lm.load + float32 forward: logits {tuple(logits.shape)}, finite {finite}, "
              f"std {float(mx.std(logits).item()):.3f}, {time.perf_counter() - t0:.1f} s, "
              f"peak RSS {_peak_rss_mb():.0f} MB")
        return 0 if finite else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
