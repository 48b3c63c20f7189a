"""Fidelity spot checks: do they separate a good variant from a damaged one, and what do they cost?

    .venv/bin/python tests/bench/fidelity_bench.py --requests 96 --damage "linear_attn.out_proj,."

1. Separation: the same greedy traffic (a third tool calls with tools offered, a third JSON
   answers under `response_format: json_object`, a third chat) against `mixbit-auto` and against
   deliberately damaged variants (mixbit-auto's plan with the tensors named by `--damage` at 2
   bits; `.` is every tensor), every request spot-checked against the in-process bf16 reference.
   Reported from each server's /v1/fidelity: mean KL(bf16 || served), top-1 agreement, flips.
2. Overhead: two mixbit-auto servers, fidelity off and 10% of requests spot-checked (defaults
   otherwise), the same load at concurrency 8 in alternating rounds (`--rounds`), aggregate
   output tokens/s per round, median and best; before each round the spot-checked server
   finishes its queued checks so they never land on the other server's round.
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
DUMP = False
CACHE = Path("~/.cache/mixbit").expanduser()  # the default cache: reuses what `mixbit eval --variants` built


def damaged_variant(pattern: str = "linear_attn.out_proj") -> Path:
    """mixbit-auto's plan with every tensor whose path contains `pattern` (alternatives split by
    `|`; `.` matches every tensor) at 2 bits, written by quant's own writer."""
    from mixbit.models.registry import resolve
    from mixbit.quant.formats import Format
    from mixbit.quant.variants import ensure_variant

    resolved = resolve("embedded:tiny-qwen3.5")
    auto = ensure_variant(resolved, "mixbit-auto", str(CACHE))
    manifest = json.loads((auto.path / "recipe.json").read_text())
    plan = {}
    for path, info in manifest["tensors"].items():
        bits = int(info.get("bits", 16))
        plan[path] = Format(2, 64) if any(p in path for p in pattern.split("|")) else \
            Format(bits, int(info.get("group_size") or 64))
    slug = pattern.replace(".", "-").replace("|", "+") if pattern != "." else "all"
    dst = ROOT / ".cache" / f"damaged-{slug}-2bit-{auto.path.name}"
    if not dst.exists():
        from mixbit.quant.variants import quantize

        quantize(resolved, f"damaged-{pattern}-2bit", dst, plan=plan, cache_root=CACHE)
    return dst


def requests(n: int) -> list[dict]:
    from mixbit.models.training import corpus

    prompts = corpus.heldout_tool_prompts(n)
    out = []
    for i, p in enumerate(prompts):
        body = {"model": MODEL, "messages": p.messages, "temperature": 0, "max_tokens": 96}
        if i % 3 == 0:
            body["tools"] = p.tools
        elif i % 3 == 1:
            name = ["Leo", "Anna", "Mia", "Omar", "Ines", "Kai", "Sara", "Tom"][i % 8]
            body["messages"] = [{"role": "user", "content": f"JSON please: name {name}, age {20 + 3 * i % 50}."}]
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
    if DUMP:
        (ROOT / ".cache" / f"fidelity-checks-{int(time.time() * 1000)}.json").write_text(json.dumps(view))
    tokens = sum(c["tokens"] for c in checks)
    return {"checks": len(checks), "tokens": tokens, "flip_count": sum(c["flips"] for c in checks),
            "kld": statistics.mean(c["kld_mean"] for c in checks),
            "top1": sum(c["top1_agreement"] * c["tokens"] for c in checks) / tokens,
            "flips": sum(c["flips"] for c in checks) / tokens,
            "seconds": statistics.mean(c["seconds"] for c in checks)}


def wait_idle(url: str, timeout: float = 900) -> None:
    """Until the server's spot-check worker has nothing queued or in progress."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        view = httpx.get(url + "/v1/fidelity?limit=1").json()
        if not view.get("enabled") or (view["queue_depth"] == 0 and not view["checking"]):
            return
        time.sleep(0.5)


def dropped(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mixbit_fidelity_dropped_total"))


def separation(bodies: list[dict], damages: list[str], concurrency: int) -> None:
    rows = {}
    servers = [("mixbit-auto", ["--recipe", "mixbit-auto"])]
    for d in damages:
        servers.append((f"damaged: {d} at 2 bits", [
            "--model", str(damaged_variant(d)), "--set", "fidelity.reference='embedded:tiny-qwen3.5'",
            "--set", f"model.served_name='{MODEL}'"]))
    for name, extra in servers:
        s = serve(name.split()[0].rstrip(":"), *extra, "--set", "fidelity.sample_rate=1.0",
                  "--set", "fidelity.max_per_minute=100000", "--set", "fidelity.queue_size=1024")
        try:
            asyncio.run(drive(s.url, bodies, concurrency))
            rows[name] = fidelity_summary(s.url, len(bodies))
        finally:
            s.stop()
    print("\n| variant | checks | tokens | mean KLD (nats/token) | top-1 agreement | flips | flip rate | s per check |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['checks']} | {r['tokens']} | {r['kld']:.4f} | {r['top1']:.4f} | {r['flip_count']} | "
              f"{r['flips']:.4f} | {r['seconds']:.2f} |")
    good = rows["mixbit-auto"]
    for name, bad in list(rows.items())[1:]:
        print(f"{name} / mixbit-auto: KLD x{bad['kld'] / max(good['kld'], 1e-12):.1f}, "
              f"flip rate x{bad['flips'] / max(good['flips'], 1e-12):.1f}")


def overhead(bodies: list[dict], concurrency: int, rounds: int) -> None:
    """Both servers up; rounds alternate between them so that drift in the machine's load hits
    both alike; before every round the spot-checked server finishes its queued checks, so the
    other one is measured without them."""
    off = serve("fidelity-off", "--recipe", "mixbit-auto", "--set", "fidelity.enabled=false")
    on = serve("fidelity-10pct", "--recipe", "mixbit-auto", "--set", "fidelity.sample_rate=0.1")
    rates: dict[str, list[float]] = {"fidelity off": [], "10% spot-checked": []}
    try:
        for s in (off, on):
            asyncio.run(drive(s.url, bodies[:8], concurrency))  # warm-up
        wait_idle(on.url)
        for _ in range(rounds):
            for label, s in (("fidelity off", off), ("10% spot-checked", on)):
                wait_idle(on.url)
                seconds, tokens = asyncio.run(drive(s.url, bodies * 2, concurrency))
                rates[label].append(tokens / seconds)
        wait_idle(on.url)
        view = httpx.get(on.url + "/v1/fidelity?limit=1000").json()
        checks, drops = len(view["checks"]), dropped(on.url)
    finally:
        off.stop()
        on.stop()
    print(f"\naggregate output tokens/s at concurrency {concurrency}, {rounds} alternating rounds "
          f"of {len(bodies) * 2} requests:")
    print("| server | rounds (tok/s) | median | best |")
    print("|---|---|---|---|")
    for label, r in rates.items():
        print(f"| {label} | {', '.join(f'{x:.1f}' for x in r)} | {statistics.median(r):.1f} | {max(r):.1f} |")
    a, b = statistics.median(rates["fidelity off"]), statistics.median(rates["10% spot-checked"])
    print(f"10% spot-checked vs off: {(b / a - 1) * 100:+.1f}% (median), "
          f"{(max(rates['10% spot-checked']) / max(rates['fidelity off']) - 1) * 100:+.1f}% (best); "
          f"checks done {checks}, dropped {drops:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the overhead run")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-separation", action="store_true")
    ap.add_argument("--damage", default="linear_attn.out_proj",
                    help="comma-separated: tensors (path substring) a damaged variant has at 2 bits")
    ap.add_argument("--dump", action="store_true", help="write every server's checks to .cache/")
    args = ap.parse_args()
    global DUMP
    DUMP = args.dump
    CACHE.mkdir(parents=True, exist_ok=True)
    bodies = requests(args.requests)
    if not args.skip_separation:
        separation(bodies, [d for d in args.damage.split(",") if d], args.concurrency)
    if not args.skip_overhead:
        overhead(bodies, args.concurrency, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
