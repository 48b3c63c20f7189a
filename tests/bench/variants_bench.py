"""Variants side by side in one process: does live fidelity tell them apart, and does a busy
variant starve another?

    .venv/bin/python tests/bench/variants_bench.py --requests 48

One `mixbit serve --variants mixbit-auto,uniform-4,uniform-3` process (each variant its own
engine; one bf16 reference for the spot checks, every request checked). The same greedy traffic
goes to each variant: a third tool calls with tools offered, a third JSON answers under
`response_format: json_object`, a third chat (fidelity_bench.py's held-out prompts). The table is
what the server's own /metrics says per `variant`: tool-call outcomes, invalid constrained outputs,
spot checks, mean KL(bf16 || served), top-1 agreement and flips per checked token.

Starvation: end-to-end latency of single requests to uniform-3 alone, then the same requests
while mixbit-auto serves `--load` concurrent requests non-stop (median and max of each).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_bench import MODEL, requests, serve, wait_idle  # noqa: E402

VARIANTS = ["mixbit-auto", "uniform-4", "uniform-3"]


def per_variant(metrics_text: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            v = s.labels.get("variant")
            if v is None:
                continue
            key = s.name + "".join(f"|{s.labels[k]}" for k in ("outcome", "kind") if k in s.labels
                                   and s.name.startswith(("mixbit_tool_call", "mixbit_constrained")))
            out[v][key] += s.value
    return out


async def drive(url: str, bodies: list[dict], concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    latencies = []
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(body):
            async with sem:
                started = time.perf_counter()
                r = await client.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - started)
        await asyncio.gather(*(one(b) for b in bodies))
    return latencies


async def starvation(url: str, probe: list[dict], load: list[dict], concurrency: int) -> tuple[list, list]:
    alone = await drive(url, probe, 1)
    stop = asyncio.Event()

    async def background():
        while not stop.is_set():
            await drive(url, load, concurrency)

    task = asyncio.create_task(background())
    await asyncio.sleep(2.0)  # the busy variant's batch is full before the probes start
    busy = await drive(url, probe, 1)
    stop.set()
    await task
    return alone, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48, help="requests per variant")
    ap.add_argument("--concurrency", type=int, default=4, help="per variant, all variants at once")
    ap.add_argument("--probes", type=int, default=8, help="starvation: single requests to uniform-3")
    ap.add_argument("--load", type=int, default=8, help="starvation: concurrent requests to mixbit-auto")
    args = ap.parse_args()

    server = serve("variants", "--variants", ",".join(VARIANTS), "--set", "fidelity.sample_rate=1.0",
                   "--set", "fidelity.max_per_minute=100000", "--set", "fidelity.queue_size=1024")
    try:
        base = requests(args.requests)
        started = time.perf_counter()

        async def all_variants():
            return await asyncio.gather(*(drive(server.url, [{**b, "model": f"{MODEL}:{v}"} for b in base],
                                                args.concurrency) for v in VARIANTS))
        latencies = dict(zip(VARIANTS, asyncio.run(all_variants())))
        wall = time.perf_counter() - started
        wait_idle(server.url)
        stats = per_variant(httpx.get(server.url + "/metrics").text)
        cards = {c["mixbit"]["recipe"]: c["mixbit"] for c in httpx.get(server.url + "/v1/models").json()["data"]}
        print(f"\n{args.requests} requests per variant, {args.concurrency} at a time per variant, all three "
              f"variants at once ({wall:.0f} s); every request spot-checked against the one bf16 reference\n")
        print("| variant | bits/weight | tool calls parsed | parse failed | markup in content | invalid "
              "constrained | checks | tokens checked | mean KLD (nats/token) | top-1 agreement | flips per token | "
              "latency p50 (s) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for v in VARIANTS:
            m = stats[v]
            checks = m["mixbit_fidelity_checks_total"]
            print(f"| {v} | {cards[v]['bits_per_weight']:.2f} "
                  f"| {m['mixbit_tool_call_outcomes_total|parsed']:.0f} "
                  f"| {m['mixbit_tool_call_outcomes_total|parse_failed']:.0f} "
                  f"| {m['mixbit_tool_call_outcomes_total|markup_in_content']:.0f} "
                  f"| {sum(x for k, x in m.items() if k.startswith('mixbit_constrained_output_invalid_total')):.0f} "
                  f"| {checks:.0f} | {m['mixbit_fidelity_tokens_total']:.0f} "
                  f"| {m['mixbit_fidelity_kld_sum'] / max(m['mixbit_fidelity_kld_count'], 1):.5f} "
                  f"| {m['mixbit_fidelity_top1_agreement_sum'] / max(m['mixbit_fidelity_top1_agreement_count'], 1):.3f} "
                  f"| {m['mixbit_fidelity_flips_total'] / max(m['mixbit_fidelity_tokens_total'], 1):.4f} "
                  f"| {statistics.median(latencies[v]):.2f} |")

        probe = [{**b, "model": f"{MODEL}:uniform-3"} for b in base[:args.probes]]
        load = [{**b, "model": f"{MODEL}:mixbit-auto"} for b in base[:max(args.load * 2, 8)]]
        alone, busy = asyncio.run(starvation(server.url, probe, load, args.load))
        print(f"\nstarvation: {args.probes} single requests to uniform-3, alone and while mixbit-auto "
              f"serves {args.load} concurrent requests non-stop\n")
        print("| uniform-3 requests | latency median (s) | latency max (s) |")
        print("|---|---|---|")
        print(f"| alone | {statistics.median(alone):.2f} | {max(alone):.2f} |")
        print(f"| mixbit-auto busy | {statistics.median(busy):.2f} | {max(busy):.2f} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
