"""Writes a trained model in the published Qwen3.5 checkpoint layout.

What real checkpoints look like, and so what this writes: `config.json` with `model_type`
`qwen3_5` and a `text_config`; tensors named `model.language_model.*` plus `lm_head.weight`;
zero-centred RMSNorm weights (the model multiplies by 1 + w) except the one-centred
`linear_attn.norm`; `linear_attn.conv1d.weight` as [channels, 1, kernel]; `A_log` and
`linear_attn.norm.weight` in float32, everything else bfloat16. transformers' training module
already stores norms and conv1d this way, so only names and dtypes change here.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

FLOAT32_SUFFIXES = ("A_log", "linear_attn.norm.weight")


def published_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model.language_model." + name[len("model."):]


def export_checkpoint(model, text_config: dict, tokenizer, out: Path, train_info: dict) -> Path:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    tied = bool(text_config.get("tie_word_embeddings"))
    for name, value in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # published tied checkpoints carry the embedding only
        dtype = torch.float32 if name.endswith(FLOAT32_SUFFIXES) else torch.bfloat16
        tensors[published_name(name)] = value.detach().to(dtype).contiguous()
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": tied,
        "transformers_version": __import__("transformers").__version__,
    }
    generation = {
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "eos_token_id": [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (tmp / "training.json").write_text(json.dumps(train_info, indent=1) + "\n")
    tokenizer.save_pretrained(str(tmp))
    for keep in ("README.md",):  # the model card is written by hand and survives re-exports
        if (out / keep).exists():
            shutil.copy2(out / keep, tmp / keep)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out
