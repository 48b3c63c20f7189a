"""Fidelity spot checks: do they separate a good variant from a damaged one, and what do they cost?

    .venv/bin/python tests/bench/fidelity_bench.py [--requests 48] [--concurrency 8]

1. Separation: the same traffic (tool calls, JSON answers, chat; greedy) against `mixbit-auto`
   and against a deliberately damaged variant (mixbit-auto's plan with every
   `linear_attn.out_proj` at 2 bits), every request spot-checked against bf16. Reported: mean
   KL(bf16 || served), top-1 agreement and flip rate, from each server's /v1/fidelity.
2. Overhead: mixbit-auto with fidelity off and with 10% of requests checked, same load at
   concurrency 8, aggregate output tokens/s side by side (alternating, best of two each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ROOT, Server, free_port  # noqa: E402

MODEL = "tiny-qwen3.5"
CACHE = Path("~/.cache/mixbit").expanduser()  # the default cache: reuses what `mixbit eval --variants` built


def damaged_variant(pattern: str = "linear_attn.out_proj") -> Path:
    """mixbit-auto's plan with every tensor whose path contains `pattern` at 2 bits, written by
    quant's own writer."""
    from mixbit.models.registry import resolve
    from mixbit.quant import artifact
    from mixbit.quant.formats import Format
    from mixbit.quant.variants import ensure_variant

    resolved = resolve("embedded:tiny-qwen3.5")
    auto = ensure_variant(resolved, "mixbit-auto", str(CACHE))
    manifest = json.loads((auto.path / "recipe.json").read_text())
    plan = {}
    for path, info in manifest["tensors"].items():
        bits = int(info.get("bits", 16))
        plan[path] = Format(2, 64) if pattern in path else \
            Format(bits, int(info.get("group_size") or 64))
    dst = ROOT / ".cache" / f"damaged-{pattern.replace('.', '-')}-2bit-{auto.path.name}"
    if not dst.exists():
        from mixbit.quant import calibration as calib
        from mlx_lm.utils import load_tokenizer

        rows = calib.build(load_tokenizer(resolved.path), n_rows=4, length=64, split="heldout").rows
        artifact.write_variant(resolved.path, dst, plan, {**manifest, "recipe": "damaged-out_proj-2bit"},
                               fidelity_rows=rows)
    return dst


def requests(n: int) -> list[dict]:
    from mixbit.models import corpus

    prompts = corpus.heldout_tool_prompts(n)
    out = []
    for i, p in enumerate(prompts):
        body = {"model": MODEL, "messages": p.messages, "temperature": 0, "max_tokens": 96}
        if i % 3 == 0:
            body["tools"] = p.tools
        elif i % 3 == 1:
            body["messages"] = [{"role": "user", "content": "JSON please: name Leo, age 40."}]
            body["response_format"] = {"type": "json_object"}
        out.append(body)
    return out


async def drive(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(body):
            nonlocal tokens
            async with sem:
                r = await client.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
        started = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started, tokens


def serve(name: str, *args: str) -> Server:
    port = free_port()
    s = Server(name, [sys.executable, "-m", "mixbit.server.cli", "serve", "--port", str(port),
                      "--set", f"model.cache_dir='{CACHE}'", *args], port)
    s.wait("/ready", timeout=900)
    return s


def fidelity_summary(url: str, expect: int) -> dict:
    deadline = time.time() + 600
    while time.time() < deadline:
        view = httpx.get(url + "/v1/fidelity?limit=1000").json()
        if len(view["checks"]) >= expect:
            break
        time.sleep(1)
    checks = view["checks"]
    tokens = sum(c["tokens"] for c in checks)
    return {"checks": len(checks), "kld": statistics.mean(c["kld_mean"] for c in checks),
            "top1": sum(c["top1_agreement"] * c["tokens"] for c in checks) / tokens,
            "flips": sum(c["flips"] for c in checks) / tokens,
            "seconds": statistics.mean(c["seconds"] for c in checks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--damage", default="linear_attn.out_proj",
                    help="tensors (path substring) the damaged variant has at 2 bits")
    args = ap.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    bodies = requests(args.requests)
    damaged = damaged_variant(args.damage)
    rows = {}
    for name, extra in [("mixbit-auto", ["--recipe", "mixbit-auto"]),
                        (f"damaged ({args.damage} 2-bit)", ["--model", str(damaged),
                                                      "--set", "fidelity.reference='embedded:tiny-qwen3.5'",
                                                      "--set", f"model.served_name='{MODEL}'"])]:
        s = serve(name.split()[0], *extra, "--set", "fidelity.sample_rate=1.0",
                  "--set", "fidelity.max_per_minute=100000", "--set", "fidelity.queue_size=1024")
        try:
            asyncio.run(drive(s.url, bodies, args.concurrency))
            rows[name] = fidelity_summary(s.url, len(bodies))
        finally:
            s.stop()
    print("\n| variant | checks | mean KLD (nats/token) | top-1 agreement | flip rate | s per check |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['checks']} | {r['kld']:.4f} | {r['top1']:.3f} | {r['flips']:.3f} | {r['seconds']:.2f} |")
    good, bad = rows["mixbit-auto"], rows[f"damaged ({args.damage} 2-bit)"]
    print(f"\ndamaged / mixbit-auto: KLD x{bad['kld'] / max(good['kld'], 1e-12):.1f}, "
          f"flip rate x{bad['flips'] / max(good['flips'], 1e-12):.1f}")
    if args.skip_overhead:
        return 0
    rates: dict[str, float] = {}
    for label, sets in [("fidelity off", ["fidelity.enabled=false"]),
                        ("10% spot-checked", ["fidelity.sample_rate=0.1"])]:
        flags = [x for s_ in sets for x in ("--set", s_)]
        s = serve(label.split()[0], "--recipe", "mixbit-auto", *flags)
        try:
            asyncio.run(drive(s.url, bodies[:8], args.concurrency))  # warm-up
            best = 0.0
            for _ in range(2):
                seconds, tokens = asyncio.run(drive(s.url, bodies * 2, args.concurrency))
                best = max(best, tokens / seconds)
            rates[label] = best
        finally:
            s.stop()
    off, on = rates["fidelity off"], rates["10% spot-checked"]
    print(f"\naggregate output tokens/s at concurrency {args.concurrency}: fidelity off {off:.1f}, "
          f"10% spot-checked {on:.1f} ({(on / off - 1) * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
