"""A Qwen3.5 checkpoint as a GGUF file for llama.cpp, and mixbit's allocation as llama-quantize's
per-tensor types.

llama.cpp's own converter (`convert_hf_to_gguf.py`) refuses a checkpoint whose BPE tokenizer it
does not know by hash ("BPE pre-tokenizer was not recognized"), which is every retrained
tokenizer, the embedded model's included. The embedded tokenizer splits with Qwen3.5's own regex,
which llama.cpp knows as the `qwen35` pre-tokenizer, so this writer names it and writes the
model's own tokens and merges, through the `gguf` package (llama.cpp's, from PyPI), with no
edit to llama.cpp. The tensors go out as llama.cpp's qwen35 loader wants them, the same
transformations its converter makes:

- norms stored zero-centred get the +1 the model applies, in bf16 as mlx-lm's sanitize does,
  so both frameworks compute with the same numbers (`linear_attn.norm` is stored one-centred);
- `A_log` becomes `ssm_a = -exp(A_log)`, `dt_bias` becomes `ssm_dt.bias`;
- GatedDeltaNet value heads move from grouped-by-key-head to tiled order (ggml broadcasts tiled),
  in `in_proj_qkv`'s value rows, `in_proj_z`, `in_proj_a`/`in_proj_b`, `A_log`, `dt_bias`,
  the conv1d value channels and `out_proj`'s columns;
- `conv1d.weight` [channels, 1, kernel] drops its middle axis.

The MTP head (`mtp.*`) goes in as llama.cpp's converter writes it, so that llama-server drafts
with it (`--spec-type draft-mtp`): one more block after the decoder layers (`blk.{n}`: its
full-attention layer under the usual names, `fc` as `nextn.eh_proj`, the two pre-fc norms as
`nextn.enorm` / `nextn.hnorm`, its final norm as `nextn.shared_head_norm`; its norms get the +1
too), `nextn_predict_layers` = 1, and the extra block marked not recurrent; the embedding and
output head are the model's own (llama.cpp shares them). `mtp=False` leaves it out (a GGUF that a
llama.cpp without Qwen3.5 MTP support loads). Tensors are read one at a time from the safetensors
files (memory-mapped), so the writer's memory does not grow with the checkpoint. A tied `lm_head`
is left out. MoE checkpoints (qwen35moe) are not written yet: refused by name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from .checkpoint import Checkpoint

ARCH = "qwen35"
PRE_TOKENIZER = "qwen35"  # llama.cpp's name for Qwen3.5's split regex (llama-vocab.cpp)
# Qwen3.5's pre-tokenizer regex (its tokenizer.json Split pattern): a tokenizer that splits
# otherwise must not be written as `qwen35`, llama.cpp would tokenize it differently
QWEN35_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
                "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                      ".k_norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.norm.weight")
# the MTP head's own tensors, by llama.cpp's nextn names (its layers take the decoder's names)
NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
         "norm": "shared_head_norm"}


class GGUFExportError(ValueError):
    pass


def text_config(folder: Path) -> dict:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def write_gguf(folder: str | Path, out: str | Path, outtype: str = "bf16", name: str | None = None,
               mtp: bool = True) -> Path:
    """Writes `folder` (an HF-layout Qwen3.5 checkpoint) to `out` as GGUF; whole or not at all
    (written beside, renamed into place). `outtype`: bf16 (the weights as stored) or f32. `mtp`:
    with the checkpoint's MTP head, where it has one."""
    import gguf

    folder, out = Path(folder), Path(out)
    tc = text_config(folder)
    if tc.get("num_experts", 0):
        raise GGUFExportError(f"{folder}: MoE Qwen3.5 (qwen35moe) is not written to GGUF yet")
    if outtype not in ("bf16", "f32"):
        raise GGUFExportError(f"outtype {outtype!r}: bf16 or f32")
    ckpt = Checkpoint(folder)
    tensors = list(_tensors(ckpt, tc, outtype, mtp))
    n_mtp = mtp_layers(ckpt.entries) if mtp else 0

    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, ARCH)
    writer.add_name(name or folder.name)
    _hparams(writer, tc, gguf, outtype, n_mtp)
    _vocab(writer, folder, gguf)
    for gname, shape, kind, _ in tensors:
        qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32}[kind]
        itemsize = 2 if kind == "bf16" else 4
        writer.add_tensor_info(gname, shape, np.dtype(np.uint16 if kind == "bf16" else np.float32),
                               int(np.prod(shape)) * itemsize, raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, _, _, load in tensors:
            writer.write_tensor_data(load())
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _hparams(writer, tc: dict, gguf, outtype: str, n_mtp: int = 0) -> None:
    n_layers = tc["num_hidden_layers"]
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    rope = tc.get("rope_parameters") or {"rope_theta": tc.get("rope_theta", 10000.0),
                                         "partial_rotary_factor": tc.get("partial_rotary_factor", 0.25)}
    writer.add_block_count(n_layers + n_mtp)  # the MTP blocks follow the decoder's
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    writer.add_context_length(tc["max_position_embeddings"])
    writer.add_embedding_length(tc["hidden_size"])
    writer.add_feed_forward_length(tc["intermediate_size"])
    writer.add_head_count(tc["num_attention_heads"])
    writer.add_head_count_kv(tc["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    sections = list(rope.get("mrope_section") or [11, 11, 10])
    writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_layer_norm_rms_eps(tc["rms_norm_eps"])
    writer.add_ssm_conv_kernel(tc["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(tc["linear_key_head_dim"])
    writer.add_ssm_group_count(tc["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(tc["linear_num_value_heads"])
    writer.add_ssm_inner_size(tc["linear_value_head_dim"] * tc["linear_num_value_heads"])
    # which layers are GatedDeltaNet (the PyPI gguf 0.19.0 writer has no add_recurrent_layers yet)
    writer.add_array(f"{ARCH}.attention.recurrent_layers",
                     [t == "linear_attention" for t in _layer_types(tc)] + [False] * n_mtp)
    writer.add_full_attention_interval(tc.get("full_attention_interval", 4))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if outtype == "bf16" else gguf.LlamaFileType.ALL_F32)


def _layer_types(tc: dict) -> list[str]:
    n = tc["num_hidden_layers"]
    if tc.get("layer_types"):
        if len(tc["layer_types"]) != n:
            raise GGUFExportError(f"layer_types has {len(tc['layer_types'])} entries for {n} layers")
        return tc["layer_types"]
    k = tc.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]


def _vocab(writer, folder: Path, gguf) -> None:
    """The model's own BPE tokens and merges, typed as llama.cpp's converter types them:
    special added tokens (and any `<|...|>`) CONTROL, other added tokens USER_DEFINED."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise GGUFExportError(f"{folder}: tokenizer model {model.get('type')!r}; only byte-level BPE is written")
    if QWEN35_SPLIT not in json.dumps(spec.get("pre_tokenizer")).replace("\\\\", "\\"):
        raise GGUFExportError(f"{folder}: the tokenizer does not split with Qwen3.5's regex; llama.cpp's "
                              f"{PRE_TOKENIZER} pre-tokenizer would tokenize differently")
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in spec.get("added_tokens", [])}
    vocab.update({c: a["id"] for c, a in added.items()})
    size = max(text_config(folder)["vocab_size"], max(vocab.values()) + 1)
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif tok in added:
            tokens.append(tok)
            special = added[tok].get("special") or (tok.startswith("<|") and tok.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=size)
    special.add_to_gguf(writer)
    writer.add_add_bos_token(False)  # Qwen adds no BOS; llama-perplexity would otherwise prepend one


def _hf_names(name: str, mtp: bool = False) -> str | None:
    """The converter's names: `model.layers.N...` (the language model's prefix dropped), `mtp.*`
    for the MTP head; None for what the GGUF leaves out (a vision tower; the MTP head unless
    `mtp`)."""
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    if name.startswith("mtp."):
        return name if mtp else None
    if name.startswith(("model.visual", "vision_tower")):
        return None
    name = re.sub(r"^model\.language_model\.", "model.", name)
    return re.sub(r"^language_model\.model\.", "model.", name)


def mtp_layers(names) -> int:
    """Decoder layers of the checkpoint's MTP head (0: none)."""
    found = [int(m.group(1)) for n in names if (m := re.match(r"^(?:model\.)?mtp\.layers\.(\d+)\.", n))]
    return max(found) + 1 if found else 0


def gguf_names(names, tc: dict, mtp: bool = True) -> dict[str, str]:
    """Checkpoint tensor name -> llama.cpp qwen35 tensor name, for every tensor the GGUF holds
    (a vision tower and a tied lm_head left out; the MTP head unless `mtp`); a name llama.cpp
    has no tensor for is refused."""
    import gguf

    names = list(names)
    n_layers = tc["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, n_layers + (mtp_layers(names) if mtp else 0))
    tied = tc.get("tie_word_embeddings", False)
    out = {}
    for name in names:
        hf = _hf_names(name, mtp)
        if hf is None or (tied and hf == "lm_head.weight"):
            continue
        if hf.startswith("mtp."):  # the head's layers after the decoder's; its own tensors as nextn
            part = hf.split(".", 3)
            if part[1] == "layers" and len(part) == 4:
                hf = f"model.layers.{n_layers + int(part[2])}.{part[3]}"
            elif part[1] in NEXTN and len(part) == 3 and part[2] == "weight":
                out[name] = f"blk.{n_layers}.nextn.{NEXTN[part[1]]}.weight"
                continue
        gname = tmap.get_name(hf.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise GGUFExportError(f"{name}: no llama.cpp qwen35 tensor for it")
        out[name] = gname
    return out


def _tensors(ckpt: Checkpoint, tc: dict, outtype: str, mtp: bool) -> Iterator[tuple[str, tuple, str, callable]]:
    """(gguf name, numpy shape, bf16|f32, loader) of every tensor, in checkpoint order; each loader
    reads and transforms its one tensor when called."""
    seen = set()
    for name, gname in gguf_names(ckpt.entries, tc, mtp).items():
        entry, hf = ckpt.entries[name], _hf_names(name, mtp)
        if gname in seen:
            raise GGUFExportError(f"{name}: {gname} written twice")
        seen.add(gname)
        shape = entry.shape
        if ".conv1d." in hf:
            shape = (shape[0], shape[-1])
        one_d = len(shape) == 1 or ".conv1d." in hf
        kind = "f32" if (one_d or outtype == "f32" or entry.dtype == "F32") else "bf16"
        yield gname, tuple(shape), kind, (lambda n=name, h=hf, k=kind: _load(ckpt, n, h, k, tc))


def _load(ckpt: Checkpoint, name: str, hf: str, kind: str, tc: dict) -> np.ndarray:
    x = mx.array(np.ascontiguousarray(ckpt.view(name)))
    dtype = ckpt.entries[name].dtype
    if dtype == "BF16":
        x = x.view(mx.bfloat16)
    elif dtype not in ("F32", "F16"):
        raise GGUFExportError(f"{name}: dtype {dtype} (a quantized checkpoint?); write the bf16 one")
    if any(hf.endswith(s) for s in ZERO_CENTRED_NORMS) or hf == "model.norm.weight":
        x = x + 1.0  # in the stored dtype, as mlx-lm's sanitize adds it
    if hf.endswith(".A_log"):
        x = -mx.exp(x.astype(mx.float32))
    if ".conv1d." in hf:
        x = x.reshape(x.shape[0], x.shape[-1])
    if ".linear_attn." in hf:
        x = _tile_value_heads(x, hf, tc)
    if kind == "bf16":
        return np.array(x.astype(mx.bfloat16).view(mx.uint16))
    return np.array(x.astype(mx.float32))


def _tile_value_heads(x: mx.array, hf: str, tc: dict) -> mx.array:
    """Value heads from grouped-by-key-head order [g0v0, g0v1, g1v0, ...] to tiled [g0v0, g1v0,
    g0v1, ...] along the axis that carries them (ggml broadcasts key heads by tiling)."""
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    if nk == nv:
        return x
    dk, dv, per = tc["linear_key_head_dim"], tc["linear_value_head_dim"], nv // nk

    def tile(t: mx.array, axis: int, width: int) -> mx.array:
        shape = list(t.shape)
        t = t.reshape(shape[:axis] + [nk, per, width] + shape[axis + 1:])
        return mx.swapaxes(t, axis, axis + 1).reshape(shape)

    if ".in_proj_qkv." in hf or ".conv1d." in hf:
        qk = 2 * nk * dk
        return mx.concatenate([x[:qk], tile(x[qk:], 0, dv)], axis=0)
    if ".in_proj_z." in hf:
        return tile(x, 0, dv)
    if ".in_proj_a." in hf or ".in_proj_b." in hf or hf.endswith((".A_log", ".dt_bias")):
        return tile(x, 0, 1)
    if ".out_proj." in hf:
        return tile(x, 1, dv)
    return x


# ggml types a mixbit format maps to, by stored bits per weight (scales included): K-quants take
# 256-wide super-blocks, iq4_xs fills the 4.25 step (4-bit, 128-wide groups in MLX terms)
GGML_BPW = {"q2_K": 2.625, "q3_K": 3.4375, "iq4_xs": 4.25, "q4_K": 4.5, "q5_K": 5.5, "q6_K": 6.5625,
            "q8_0": 8.5, "bf16": 16.0}


def ggml_type_for(bits_per_weight: float) -> str:
    """The ggml type nearest in stored bits per weight (a tie goes to the larger)."""
    return min(GGML_BPW, key=lambda t: (abs(GGML_BPW[t] - bits_per_weight), -GGML_BPW[t]))


def tensor_types(variant: str | Path, mtp: bool = True) -> list[str]:
    """A mixbit variant's allocation as llama-quantize `--tensor-type-file` lines
    (`^gguf_name$=type`, one per quantized tensor), each at the ggml type nearest its bits.
    Tensors mixbit keeps in bf16 stay bf16. The variant's recipe.json names every tensor; with
    `mtp`, the MTP head's quantized tensors too (for a GGUF written with it)."""
    from .formats import Format

    variant = Path(variant)
    recipe = json.loads((variant / "recipe.json").read_text())
    # recipe paths are MLX module paths (language_model.model.layers.0.mlp.up_proj): as stored
    formats = {re.sub(r"^language_model\.model\.", "model.language_model.", p) + ".weight": t["format"]
               for p, t in recipe["tensors"].items()}
    if mtp:  # checkpoint names, each with its format or "as stored"
        formats.update({n: f for n, f in (recipe.get("mtp") or {}).get("tensors", {}).items() if f != "as stored"})
    lines = []
    for name, gname in gguf_names(formats, text_config(variant), mtp).items():
        kind = ggml_type_for(Format.parse(formats[name]).bits_per_weight())
        lines.append(f"^{re.escape(gname)}$={kind}")
    return lines
