"""Serving benchmark: mixbit against mlx_lm.server, same checkpoint, same machine, one run.

    .venv/bin/python tests/bench/serve_bench.py [--model models/tiny-qwen3.5] [--requests 16]

Both servers run on loopback with OpenBLAS preloaded when it is installed. Every request streams
/v1/completions with a distinct ~500-token prompt and 128 new tokens (end-of-turn tokens are
forbidden through logit_bias, so every request generates exactly 128). Reported: time to first
token (TTFT) p50/p95, aggregate output tokens/s at concurrency 1/4/8/16, single-stream decode
tokens/s, and TTFT per turn of a growing agent-style conversation (prefix reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = next(iter(Path("/usr/lib").glob("*/openblas-pthread/libopenblas.so.0")), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, args: list[str], port: int, env: dict | None = None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        if OPENBLAS:
            env["LD_PRELOAD"] = str(OPENBLAS)
        self.log = open(ROOT / ".cache" / f"bench-{name}.log", "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, path: str, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} did not start; see .cache/bench-{self.name}.log")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def make_prompts(tokenizer, n: int, target_tokens: int = 500, seed: int = 0) -> list[str]:
    from mixbit.models.training import catalogue, corpus

    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        doc = corpus.tool_episode(rng)
        tools = [f.schema() for f in rng.sample(catalogue.FUNCTIONS, 3)]
        text = tokenizer.apply_chat_template(doc["messages"][:1] if doc["messages"][0]["role"] == "user"
                                             else doc["messages"][:2], tools=tools, tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        text = f"Request {i} {rng.randint(0, 10**9)}.\n" + text  # distinct from the first token
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < target_tokens:
            text = text.replace("<|im_start|>user\n", "<|im_start|>user\nPlease help me. ", 1)
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(text)
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      bias: dict) -> tuple[float, float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "logit_bias": bias}
    start = time.perf_counter()
    first = None
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:  # a failure after the 200 (streamed): no number may come of it
                raise RuntimeError(f"{model}: the stream ended with an error: {data['error']}")
            for c in data.get("choices", []):
                if c.get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    if not chunks:
        raise RuntimeError(f"{model}: a request produced no text")
    return (first or end) - start, end - start, chunks


async def load_test(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    bias: dict) -> dict:
    sem = asyncio.Semaphore(concurrency)
    # a connection per request: llama-server closed an idle kept-alive connection just as the
    # next request went out on it ("Server disconnected without sending a response")
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def guarded(p):
            async with sem:
                return await one_request(client, url, model, p, max_tokens, bias)
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    decode = [(max_tokens - 1) / (r[1] - r[0]) for r in results if r[1] > r[0]]
    return {"tok_s": len(prompts) * max_tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))],
            "decode_tok_s": statistics.median(decode) if decode else 0.0}


async def multi_turn(url: str, model: str, tokenizer, turns: int, bias: dict) -> list[float]:
    """An agent loop: each turn resends the whole history plus a tool result; TTFT per turn."""
    from mixbit.models.training import catalogue

    tools = [f.schema() for f in catalogue.FUNCTIONS[:4]]
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(turns):
            prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=False)
            ttft, _, _ = await one_request(client, url, model, prompt, 32, bias)
            out.append(ttft)
            messages += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": f"City{t}"}}}]},
                {"role": "tool", "content": json.dumps({"temperature_c": t, "condition": "cloudy",
                                                        "notes": "x " * 60})}]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-qwen3.5"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--only", choices=["mixbit", "mixbit-bf16", "mlx_lm"], help="run one server only")
    ap.add_argument("--servers", default="mixbit,mlx_lm",
                    help="comma-separated: mixbit (the configured recipe), mixbit-bf16, mlx_lm")
    args = ap.parse_args()
    (ROOT / ".cache").mkdir(exist_ok=True)

    from transformers import AutoTokenizer
    from tokenizers import Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    bias = {str(raw.token_to_id(t)): -100 for t in ("<|im_end|>", "<|endoftext|>")}
    levels = [int(c) for c in args.concurrency.split(",")]
    def mixbit(name: str, *extra: str):
        return lambda p: Server(name, [sys.executable, "-m", "mixbit.server.cli", "serve", "--model",
                                       args.model, "--port", str(p), "--set", "server.log_level='warning'",
                                       "--set", "server.max_concurrent_sequences=16", *extra], p)

    every = {
        "mixbit": mixbit("mixbit"),  # what `make serve` serves: the configured recipe
        "mixbit-bf16": mixbit("mixbit-bf16", "--recipe", "bf16"),
        "mlx_lm": lambda p: Server("mlx_lm", [sys.executable, "-m", "mlx_lm.server", "--model", args.model,
                                              "--port", str(p), "--log-level", "WARNING"], p),
    }
    servers = {n: every[n] for n in args.servers.split(",")}
    results: dict[str, dict] = {}
    for name, make in servers.items():
        if args.only and name != args.only:
            continue
        port = free_port()
        server = make(port)
        try:
            server.wait("/ready" if name != "mlx_lm" else "/health", timeout=900)
            # mlx_lm.server's /v1/models lists the Hugging Face cache, not what it serves (and
            # fails without one); it answers to the path it was started with.
            model_id = (httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                        if name != "mlx_lm" else args.model)
            warm = make_prompts(tokenizer, 2, seed=99)
            asyncio.run(load_test(server.url, model_id, warm, 2, 8, bias))
            res = {}
            for c in levels:
                prompts = make_prompts(tokenizer, args.requests, seed=c)
                try:
                    res[c] = asyncio.run(load_test(server.url, model_id, prompts, c, args.max_tokens, bias))
                except (httpx.HTTPError, OSError) as exc:  # a server that falls over is a result too
                    res[c] = {"failed": f"{type(exc).__name__}"}
                    server.stop()
                    server = make(free_port())
                    server.wait("/ready" if name != "mlx_lm" else "/health", timeout=900)
                print(f"{name} c={c}: {res[c]}", file=sys.stderr)
            try:
                res["turns"] = asyncio.run(multi_turn(server.url, model_id, tokenizer, args.turns, bias))
            except (httpx.HTTPError, OSError):
                res["turns"] = [float("nan")] * args.turns
            results[name] = res
        finally:
            server.stop()

    names = list(results)
    print(f"\nmodel: {args.model}; {args.requests} requests of ~500 prompt tokens, {args.max_tokens} new "
          f"tokens each; OpenBLAS preloaded: {bool(OPENBLAS)}\n")
    header = "| metric | " + " | ".join(names) + " |"
    print(header)
    print("|" + "---|" * (len(names) + 1))
    def cell(n, c, fmt):
        r = results[n][c]
        return r["failed"] + " (server failed)" if "failed" in r else fmt(r)

    for c in levels:
        print(f"| c={c} aggregate output tok/s | " + " | ".join(
            cell(n, c, lambda r: f"{r['tok_s']:.1f}") for n in names) + " |")
        print(f"| c={c} TTFT p50 / p95 (s) | " + " | ".join(
            cell(n, c, lambda r: f"{r['ttft_p50']:.2f} / {r['ttft_p95']:.2f}") for n in names) + " |")
    print("| single-stream decode tok/s after the first token (c=1) | " + " | ".join(
        cell(n, levels[0], lambda r: f"{r['decode_tok_s']:.1f}") for n in names) + " |")
    turns = max(len(results[n]["turns"]) for n in names)
    for t in range(turns):
        print(f"| agent turn {t + 1} TTFT (s) | " + " | ".join(f"{results[n]['turns'][t]:.3f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
