"""Builds the embedded model's byte-level BPE tokenizer in Hugging Face layout.

The pre-tokenizer isolates whitespace runs, letter runs, single digits and punctuation runs, so a
word has the same ids after a space, after a newline and at the start of a line: an argument value
in the user's words and in `<parameter=...>\nVALUE\n` is the same token sequence, which is what
lets a small model learn to copy it. Qwen's special tokens keep their names and roles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Merges are learned on these isolated pieces, so no merge ever joins a space, newline or
# punctuation mark to a letter ...
ISOLATING_REGEX = r"\s+|[\p{L}\p{M}]+|\p{N}|[^\s\p{L}\p{M}\p{N}]+"
# ... and the tokenizer is then saved with Qwen3.5's own pre-tokenizer rule. transformers forces
# its `Qwen3_5Tokenizer` (which hard-codes this rule) on every `qwen3_5` checkpoint, and mlx-lm
# loads through transformers; with merges that never cross those boundaries, ' Oslo' still
# becomes 'Ġ' + 'Oslo', and every loader tokenizes identically (tests/test_tokenizer.py).
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
              r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (content, special): Qwen marks the turn tokens special and leaves tool/think markup visible.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
]
CHAT_TEMPLATE_PATH = Path(__file__).parents[1] / "chat" / "chat_template.jinja"


def _pre_tokenizer(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(ISOLATING_REGEX)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.pre_tokenizer = _pre_tokenizer(QWEN_REGEX)
    # special=False tokens still match as whole units, and are decoded as text
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in ADDED_TOKENS if not s])
    return tok


def write_tokenizer_files(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for content, special in ADDED_TOKENS:
        added[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}
    config = {
        # Not "Qwen3_5Tokenizer": that class replaces our pre-tokenizer with Qwen's own regex
        # (see shared/scoping-facts.md), and training and serving would tokenize differently.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE_PATH.read_text())
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
