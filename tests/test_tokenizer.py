"""Training and serving tokenize identically: `tokenizers`, transformers and mlx-lm agree.

transformers forces its Qwen3_5Tokenizer (with Qwen's own pre-tokenizer) on every qwen3_5
checkpoint, and mlx-lm loads through transformers; the embedded tokenizer is built so that this
changes nothing (see models/training/tokenizer.py).
"""

import random

import pytest

TRICKY = [
    "def f(x):\n    return x  \n\n\n  y\t\tz", "What's the weather in Oslo?", "It's 5 o'clock, isn't it?",
    "héllo wörld — ünïcode 東京 🙂", "a  b   c\r\nd", "  leading and trailing  ", "<tool_call>\n<function=x>\n",
    '{"a": [1, 2.5, "x"], "b": null}', "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
]


@pytest.fixture(scope="module")
def tokenizers_three(embedded_path):
    from mlx_lm import load
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(embedded_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(embedded_path))
    _, wrapper = load(str(embedded_path))
    return raw, auto, wrapper


def test_same_ids_everywhere(tokenizers_three):
    from mixbit.models.training import corpus
    from mixbit.models.training.train import render

    raw, auto, wrapper = tokenizers_three
    rng = random.Random(11)
    texts = TRICKY + [render(auto, corpus.document(rng, corpus.MIX)) for _ in range(60)]
    for text in texts:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert auto.encode(text, add_special_tokens=False) == ids, text[:60]
        assert wrapper.encode(text, add_special_tokens=False) == ids, text[:60]
        assert auto.decode(ids) == text


def test_a_word_is_the_same_tokens_after_space_newline_and_start(tokenizers_three):
    raw, _, _ = tokenizers_three
    for word in ["Oslo", "Zuvaleth", "AAPL", "Buenos Aires"]:
        alone = raw.encode(word, add_special_tokens=False).ids
        assert raw.encode(" " + word, add_special_tokens=False).ids[1:] == alone
        assert raw.encode("\n" + word, add_special_tokens=False).ids[1:] == alone


def test_special_tokens_are_single_ids(tokenizers_three):
    _, auto, _ = tokenizers_three
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
              "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert len(auto.encode(t, add_special_tokens=False)) == 1, t
    assert auto.eos_token == "<|im_end|>"


def test_the_served_tokenizer_keeps_no_build_copies_and_tokenizes_the_same(embedded_path, tokenizers_three,
                                                                            tmp_path):
    """The server's loader takes the tokenizer as tokenizer.json says (transformers' fast
    tokenizer over the Rust one), without the Python vocabulary and merges AutoTokenizer's
    Qwen3_5Tokenizer keeps after building it (~130 MB at Qwen3.5's vocabulary): ids, decoding,
    the chat template and saving are those of the other loaders."""
    from mixbit.models.loading import load
    from mixbit.models.chat.template import render_chat
    from mixbit.models.registry import resolve
    from transformers import AutoTokenizer

    raw, _, wrapper = tokenizers_three
    lm = load(resolve(str(embedded_path), allow_download=False), cpu_quantized="dense")
    served, hf = lm.tokenizer, lm.hf_tokenizer
    assert type(hf).__name__ != "Qwen3_5Tokenizer"
    assert not hasattr(hf, "_vocab") and not hasattr(hf, "_merges")
    hf.save_pretrained(str(tmp_path))
    saved = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TRICKY:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert served.encode(text, add_special_tokens=False) == ids, text[:60]
        assert saved.encode(text, add_special_tokens=False) == ids, text[:60]
        assert served.decode(ids) == text
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    assert render_chat(served, messages) == render_chat(wrapper, messages)
