"""Grammar engine cost at the embedded model's vocabulary and at Qwen3.5's real one (248k).

    .venv/bin/python tests/bench/grammar_bench.py [--outlines] [--steps 64]

Prints one table: tokenizer build, grammar compile (cold and cached), per-step mask time (mean
and p99), mask application to MLX logits (our bit-unpack + mx.where vs a numpy unpack), and the
decode step overhead of constrained decoding on the embedded model at batch 1 and 8 (the same
engine, 128 tokens per sequence, end-of-turn banned so both runs decode every step). With
--outlines, outlines-core (the engine the design card named) is measured on the same schemas
when it is installed (`pip install outlines-core`; not a dependency of mixbit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixbit.models.chat.grammar import (GrammarEngine, _apply_mask, chat_grammar,  # noqa: E402
                                   json_grammar)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "send_email", "parameters": {
        "type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                         "cc": {"type": "array", "items": {"type": "string"}}},
        "required": ["to", "subject"]}}},
]
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                 "required": ["name"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}},
    "express": {"type": "boolean"}}, "required": ["customer", "items"]}

CASES = {  # name -> (grammar, a valid output to walk the mask along)
    "tool call (2 tools, XML)": (
        chat_grammar(TOOLS, "required", True, None, False, "xml"),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "json_schema strict (order)": (
        json_grammar(ORDER, True, False),
        json.dumps({"customer": {"name": "Anna Berg", "email": "anna@example.com"},
                    "items": [{"sku": "AB-123", "qty": 2}, {"sku": "ZX-9", "qty": 1}], "express": True})),
    "json_object (any JSON)": (
        json_grammar(None, False, False),
        json.dumps({"answer": "yes", "values": [1, 2.5, None], "nested": {"ok": True}})),
}


def tokenizers():
    from transformers import AutoTokenizer

    from qwen_vocab import VOCAB_SIZE, build

    embedded = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3.5"
    tiny = AutoTokenizer.from_pretrained(str(embedded))
    return [("embedded (4,096)", tiny, 4096), ("Qwen3.5 (248,320)", build(), VOCAB_SIZE)]


def pct(values, q):
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def llguidance_rows(label, hf, vocab):
    rows = []
    started = time.perf_counter()
    eos = [hf.convert_tokens_to_ids("<|im_end|>")]
    engine = GrammarEngine(hf, vocab, eos)
    build_s = time.perf_counter() - started
    for name, (grammar, valid) in CASES.items():
        t0 = time.perf_counter()
        compiled = engine.compile(grammar)
        cold_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        for _ in range(100):
            engine.processor(engine.compile(grammar))
        cached_ms = (time.perf_counter() - t0) * 1000 / 100
        m = compiled.prototype.deep_copy()
        ids = hf.encode(valid, add_special_tokens=False)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.compute_bitmask()
            times.append((time.perf_counter() - t0) * 1e6)
            assert m.consume_token(t), m.get_error()
        rows.append(("llguidance", label, name, f"{build_s:.2f}", f"{cold_ms:.1f}", f"{cached_ms:.3f}",
                     f"{statistics.mean(times):.0f}", f"{pct(times, 0.99):.0f}"))
    return rows


def outlines_rows(label, hf, vocab):
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return [("outlines-core", label, "(not installed)", "", "", "", "", "")]
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    started = time.perf_counter()
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    mapping: dict[bytes, list[int]] = {}
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items()}
    for token, i in hf.get_vocab().items():
        if i == eos or i in special:
            continue
        mapping.setdefault(bytes(byte_of[c] for c in token), []).append(i)
    vocabulary = Vocabulary(eos, mapping)
    build_s = time.perf_counter() - started
    rows = []
    schemas = {"tool call (2 tools, XML)": ("get_weather arguments (JSON)", TOOLS[0]["function"]["parameters"],
                                            json.dumps({"city": "San Francisco", "days": 3})),
               "json_schema strict (order)": ("json_schema strict (order)", ORDER,
                                              CASES["json_schema strict (order)"][1])}
    for _, (name, schema, valid) in schemas.items():
        t0 = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
        cold_ms = (time.perf_counter() - t0) * 1000
        guide = Guide(index)
        mask = np.zeros(((vocab + 31) // 32,), dtype=np.int32)
        times = []
        ids = hf.encode(valid, add_special_tokens=False)
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append((time.perf_counter() - t0) * 1e6)
            try:
                guide.advance(t)
            except Exception:  # noqa: BLE001 - outlines' canonical tokenization differs
                break
        rows.append(("outlines-core", label, name, f"{build_s:.2f}", f"{cold_ms:.1f}", "",
                     f"{statistics.mean(times):.0f}", f"{pct(times, 0.99):.0f}"))
    return rows


def mask_apply_rows(vocab):
    words = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(vocab + 31) // 32, dtype=np.int32)
    logits = mx.random.normal((vocab,))
    mx.eval(logits)
    out = []
    for name, fn in [("bit-unpack + mx.where (compiled)", lambda: _apply_mask(logits, mx.array(words))),
                     ("numpy unpackbits + mx.where", lambda: mx.where(mx.array(np.unpackbits(
                         words.view(np.uint8), bitorder="little")[:vocab].astype(bool)), logits, -mx.inf))]:
        for _ in range(5):
            mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(200):
            mx.eval(fn())
        out.append((name, vocab, (time.perf_counter() - t0) * 1000 / 200))
    return out


def decode_overhead(batch: int, tokens: int = 128):
    from mixbit.models.loading import load
    from mixbit.models.chat.template import render_chat
    from mixbit.models.registry import resolve
    from mixbit.server.engine import Engine, FinishEvent, async_emitter
    from mixbit.server.sampling import SamplingParams

    lm = load(resolve("embedded:tiny-qwen3.5"))
    cfg = lm.config.get("text_config", lm.config)
    grammar = GrammarEngine(lm.tokenizer._tokenizer, cfg["vocab_size"], sorted(lm.tokenizer.eos_token_ids))
    compiled = grammar.compile(json_grammar({"type": "object", "properties": {"notes": {
        "type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 100}},
        "required": ["notes"]}, True, False))
    ban = {t: -100.0 for t in lm.tokenizer.eos_token_ids}
    prompt = lm.tokenizer.encode(render_chat(lm.tokenizer, [{"role": "user", "content": "Tell me about Oslo."}]),
                                 add_special_tokens=False)
    engine = Engine(lm.model, lm.tokenizer, max_batch=batch, cache_entries=0)
    engine.start()

    async def run(constrained: bool) -> float:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in range(batch)]
        t0 = time.perf_counter()
        for i, q in enumerate(queues):
            extra = [grammar.processor(compiled)] if constrained else None
            engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, logit_bias=ban),
                          async_emitter(loop, q), extra_processors=extra)
        done = 0
        for q in queues:
            while not isinstance(await q.get(), FinishEvent):
                pass
            done += 1
        return batch * tokens / (time.perf_counter() - t0)

    results = {}
    for constrained in (False, True) * 3:  # alternate, keep the best of three
        rate = asyncio.run(run(constrained))
        results[constrained] = max(results.get(constrained, 0), rate)
    engine.close()
    return results[False], results[True]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outlines", action="store_true", help="also measure outlines-core")
    args = ap.parse_args()
    rows = []
    for label, hf, vocab in tokenizers():
        rows += llguidance_rows(label, hf, vocab)
        if args.outlines:
            rows += outlines_rows(label, hf, vocab)
    head = ("engine", "vocabulary", "grammar", "tokenizer s", "compile ms (cold)",
            "compile ms (cached)", "mask µs mean", "mask µs p99")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    print("\nmask application to MLX logits (ms per step):")
    for vocab in (4096, 248320):
        for name, v, ms in mask_apply_rows(vocab):
            print(f"  {name:<34} vocab {v:>7}: {ms:.3f} ms")
    print("\ndecode throughput on the embedded model, same engine, 128 tokens per sequence:")
    for batch in (1, 8):
        free, constrained = decode_overhead(batch)
        print(f"  batch {batch}: unconstrained {free:7.1f} tok/s, constrained {constrained:7.1f} tok/s "
              f"({(free / constrained - 1) * 100:+.1f}% time per step)")


if __name__ == "__main__":
    main()
