"""Self-speculative decoding with the MTP head, against plain decoding of the same model, in one run.

    .venv/bin/python tests/bench/mtp_bench.py [--shape embedded,0.8b] [--drafts 1,2] [--tokens 96]
        [--acceptance 0.6,0.8,0.9] [--prompts 8] [--draft-vocab 32768]

Rows, each on mixbit's own decode loop (server/batching.py) in this process, one sequence at a
time (c=1), temperature 0, the decode rate counted from the first generated token to the last:
- the embedded model (bf16, as `make serve` serves it): held-out chat and tool prompts of its
  corpus, drafts from its trained MTP head; acceptance is what the head earns;
- a real Qwen3.5 shape (random weights: .cache/shapes/<shape>, its mixbit-auto variant from
  kernel_serve_bench's cache, quantized there at first use): random weights accept nothing, so a
  replay draft measures the machinery: the MTP head runs as usual (its cost is paid) and only
  its proposals are replaced by the tokens the plain run produced, each wrong at the rate 1 -
  acceptance (benchmark only; the served engine never replays);
- at a real shape, each MTP row twice: the head drafting over the whole vocabulary and over the
  --draft-vocab most frequent tokens (FR-Spec; the served default);
- c=8 (eight prompts decoding together; drafting is off in a batch, but every step keeps the head's
  cache in step): the aggregate rate with MTP against without;
- with --llama: llama-server (tests/bench/llama_cpp.py builds it) on the same prompt tokens, one
  request at a time, without and with its own MTP drafting (`--spec-type draft-mtp`, the same
  number of drafts): the embedded model as `mixbit export --gguf` writes it (bf16, with the head),
  a real shape as llama.cpp's converter writes it (with the head), quantized to --llama-quant.
  Its decode rate is llama-server's own (`timings`), its acceptance `draft_n_accepted / draft_n`;
  on random weights its head accepts nothing (llama.cpp has no replay), so that row is its cost.

Every MTP row's tokens are compared with the plain run's ("same": token-identical).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load_embedded():
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    return load(resolve(str(ROOT / "models" / "tiny-qwen3.5")))


def load_shape(shape: str):
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve
    from tests.bench.kernel_serve_bench import CACHE, _variant_folder, shape_checkpoint

    folder, _, _ = shape_checkpoint(shape)
    variant = _variant_folder("mixbit-auto", folder)
    if variant is None:
        raise SystemExit(f"no mixbit-auto variant of {folder} in {CACHE}: run "
                         f"tests/bench/kernel_serve_bench.py --shape {shape} --variants mixbit-auto first")
    # the plan `mixbit serve` runs it on (measured once here, kept beside kernel_serve_bench's)
    return load(resolve(str(folder)), path=variant, cpu_quantized="auto", cpu_activations="auto",
                plan_dir=CACHE / "cpu-plans")


def embedded_prompts(lm, n: int) -> list[list[int]]:
    from mixbit.models.chat.template import render_chat
    from mixbit.models.training import corpus

    tool = corpus.heldout_tool_prompts(n - n // 2)
    plain = corpus.heldout_plain_prompts(n // 2)
    out = []
    for p in [x for pair in zip(tool, plain) for x in pair] + tool[len(plain):]:
        text = render_chat(lm.tokenizer, p.messages, tools=p.tools, enable_thinking=False)
        out.append(lm.tokenizer.encode(text, add_special_tokens=False))
    return out[:n]


def shape_prompts(lm, n: int) -> list[list[int]]:
    rng = random.Random(0)
    words = ["agent", "tool", "weather", "file", "python", "function", "result", "city", "token", "json"]
    return [lm.tokenizer.encode(f"Request {i}: " + " ".join(rng.choice(words) for _ in range(200)),
                                add_special_tokens=False)[:256] for i in range(n)]


def decode(lm, prompts, tokens: int, stops, spec=None, replay=None, batch: int = 1):
    """(tokens of each prompt, decode tok/s, counters): `batch` prompts at a time."""
    import mlx.core as mx

    from mixbit.server.batching import BatchLoop
    from mixbit.server.speculative import SpecCounters

    counters, out, decode_s, decoded = SpecCounters(), {}, 0.0, 0
    for at in range(0, len(prompts), batch):
        group = prompts[at:at + batch]
        uids: dict = {}
        loop = BatchLoop(lm.model, stop_tokens=stops, speculate=spec, counters=counters,
                         max_batch=batch, prefill_batch=batch,
                         replay=None if replay is None else lambda uid, n, k: replay(uids[uid], n, k))
        uids.update({loop.insert([p], tokens): at + i for i, p in enumerate(group)})
        first_at = None
        while len(loop):
            _, gen = loop.next()
            for g in gen:
                out.setdefault(uids[g.uid], []).append(g.token)
            if gen and first_at is None:
                first_at, first_n = time.perf_counter(), sum(len(out[i]) for i in out if i >= at)
        mx.eval(mx.array(0))
        decode_s += time.perf_counter() - first_at
        decoded += sum(len(out[i]) for i in out if i >= at) - first_n
        mx.clear_cache()
    return [out[i] for i in range(len(prompts))], decoded / decode_s, counters


def llama_gguf(shape: str, quant: str) -> tuple[Path, str]:
    """(GGUF with the MTP head, its label): the embedded model as mixbit exports it (bf16), a real
    shape as llama.cpp's converter writes it, quantized to `quant`."""
    from tests.bench.kernel_serve_bench import GGUF, gguf, shape_checkpoint
    from tests.bench.llama_cpp import build

    src = build(("llama-server", "llama-quantize"))
    if shape == "embedded":
        from mixbit.quant.gguf_export import write_gguf

        out = GGUF / "embedded-mtp-bf16.gguf"
        if not out.exists():
            GGUF.mkdir(parents=True, exist_ok=True)
            write_gguf(ROOT / "models" / "tiny-qwen3.5", out)
        return out, "bf16"
    folder, _, _ = shape_checkpoint(shape)
    return gguf(src, folder, shape, quant), quant


def llama_decode(model: Path, prompts, tokens: int, drafts: int) -> tuple[float, float, list]:
    """(decode tok/s over all prompts, draft acceptance, tokens of each) from llama-server, one
    request at a time, greedy; `drafts` > 0 drafts with the GGUF's MTP head."""
    import httpx

    from tests.bench.llama_cpp import tool
    from tests.bench.serve_bench import Server, free_port

    port = free_port()
    spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(drafts)] if drafts else []
    server = Server(f"llama-mtp{drafts}", [str(tool("llama-server")), "-m", str(model), "-t", "2", "-np", "1",
                                           "-c", "8192", "--host", "127.0.0.1", "--port", str(port), *spec], port)
    try:
        server.wait("/health", timeout=600)

        def complete(p):
            return httpx.post(server.url + "/completion", json={
                "prompt": p, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True}, timeout=600).json()

        complete(prompts[0])  # warm-up
        n = ms = drafted = accepted = 0
        out = []
        for p in prompts:
            r = complete(p)
            out.append(r.get("tokens", []))
            t = r["timings"]
            n, ms = n + t["predicted_n"], ms + t["predicted_ms"]
            drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
        return n / ms * 1000, accepted / drafted if drafted else float("nan"), out
    finally:
        server.stop()


def make_replay(recorded: list[list[int]], acceptance: float, vocab: int, seed: int = 0):
    """replay(prompt index, tokens generated, k): the plain run's next k tokens, each replaced
    by another at the rate 1 - acceptance."""
    rng = random.Random(seed)

    def replay(prompt, generated, k):
        truth = recorded[prompt]
        out = []
        for j in range(k):
            right = truth[min(generated + j, len(truth) - 1)]
            out.append(right if rng.random() < acceptance else (right + 1 + rng.randrange(vocab - 1)) % vocab)
        return out
    return replay


def main(argv=None) -> int:
    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()
    from mixbit.server.speculative import Speculation, draft_vocabulary

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="embedded,0.8b")
    ap.add_argument("--drafts", default="1,2")
    ap.add_argument("--acceptance", default="0.6,0.8,0.9")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="also draft over this many frequent tokens (generation.mtp_draft_vocab)")
    ap.add_argument("--c8", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--llama", action="store_true", help="llama-server beside, without and with draft-mtp")
    ap.add_argument("--llama-quant", default="Q4_K_M", help="llama-quantize type for a real shape's GGUF")
    args = ap.parse_args(argv)
    drafts = [int(x) for x in args.drafts.split(",") if x]
    rows = []
    for shape in [s for s in args.shape.split(",") if s]:
        lm = load_embedded() if shape == "embedded" else load_shape(shape)
        if lm.model.mtp is None:
            print(f"{shape}: the checkpoint has no MTP head; skipped")
            continue
        prompts = embedded_prompts(lm, args.prompts) if shape == "embedded" else shape_prompts(lm, args.prompts)
        stops = sorted(lm.tokenizer.eos_token_ids) if shape == "embedded" else []
        decode(lm, prompts[:1], 8, stops)  # warm-up
        base, base_rate, _ = decode(lm, prompts, args.tokens, stops)
        rows.append((shape, "plain", "-", "-", base_rate, 1.0, "-"))
        vocab = lm.model.language_model.args.vocab_size
        draft_vocabs = [0] + [v for v in (args.draft_vocab,) if 0 < v < vocab]
        for k in drafts:
            accs = [None] if shape == "embedded" else [float(a) for a in args.acceptance.split(",")]
            for dv in draft_vocabs:
                lm.model.set_draft_vocab(draft_vocabulary(lm.hf_tokenizer, dv) if dv else None)
                for acc in accs:
                    replay = None if acc is None else make_replay(base, acc, vocab)
                    toks, rate, c = decode(lm, prompts, args.tokens, stops, Speculation(drafts=k), replay)
                    same = sum(a == b for a, b in zip(toks, base))
                    label = f"{c.acceptance:.2f}" + ("" if acc is None else f" (replay {acc})")
                    how = f"mtp k={k}, drafts over {dv if dv else 'all'} tokens"
                    rows.append((shape, how, label, "/".join(str(x) for x in c.accepted_per_position),
                                 rate, rate / base_rate, f"{same}/{len(base)}"))
            lm.model.set_draft_vocab(None)
        if args.c8:
            n8 = max(8, len(prompts) // 8 * 8)
            p8 = (prompts * 8)[:n8]
            _, plain8, _ = decode(lm, p8, args.tokens, stops, batch=8)
            _, mtp8, _ = decode(lm, p8, args.tokens, stops, Speculation(drafts=drafts[0]), batch=8)
            rows.append((shape, "c=8 plain", "-", "-", plain8, 1.0, "-"))
            rows.append((shape, f"c=8 mtp on (k={drafts[0]})", "-", "-", mtp8, mtp8 / plain8, "-"))
        if args.llama:
            model, what = llama_gguf(shape, args.llama_quant)
            for k in [0] + drafts[:1]:
                rate, acc, toks = llama_decode(model, prompts, args.tokens, k)
                label = "-" if not k else f"{acc:.2f}"
                # the same greedy tokens as mixbit's plain run (llama.cpp stops at end-of-text too)
                same = f"{sum(a == b[:len(a)] for a, b in zip(toks, base))}/{len(base)}" if shape == "embedded" else "-"
                rows.append((shape, f"llama-server {what}" + (f", draft-mtp k={k}" if k else ""), label, "-",
                             rate, rate / base_rate, same))
        del lm
    print("\n| model | decoding | acceptance | accepted by position | decode tok/s | vs plain | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for shape, how, acc, pos, rate, ratio, same in rows:
        print(f"| {shape} | {how} | {acc} | {pos} | {rate:.1f} | {ratio:.2f}x | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
