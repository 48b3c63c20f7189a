"""Serving at a real Qwen3.5 shape, side by side in one run: mixbit (bf16 and its quantized
variants, served packed on the CPU kernels), llama.cpp's llama-server (Q4_K_M and bf16 GGUF of the
same checkpoint) and, with --peers mlx_lm, mlx_lm.server on the same folders.

    .venv/bin/python tests/bench/kernel_serve_bench.py [--shape 0.8b] [--variants bf16,mixbit-auto]
        [--peers llama] [--build-llama]

The checkpoint has random weights in the published layout (tests/bench/real_shapes.py; written
once to .cache/shapes/<shape>): it measures time and memory, not quality. mixbit quantizes it
into .cache/bench-cache at its first start (about 8 minutes for 0.8B here) and reuses that after.
llama-server: LLAMA_CPP_DIR (a llama.cpp source tree with build/bin/llama-server), or
--build-llama builds it from the llama.cpp sources inside the llama-cpp-python sdist (PyPI) into
.cache/llama.cpp (cmake targets llama-server and llama-quantize, about 15 minutes on 2 cores); its
convert_hf_to_gguf.py (needs torch: `pip install -e .[train]`) converts the same folder.

Load, as in issue 16: distinct ~300-token prompts through /v1/completions (streamed), 64 new tokens
each (end-of-text tokens forbidden through logit_bias), temperature 0, one server at a time:
c=1 (sequential) and c=8. Reported per server: bytes of the weights, c=1 aggregate output tok/s,
c=1 decode tok/s per request (after the first token), TTFT at c=1 and c=8 (p50), c=8 aggregate
tok/s, and peak resident memory while serving (VmRSS sampled every 0.2 s). mixbit runs with
fidelity spot checks off (their bf16 reference is a second model in memory; docs/fidelity.md) and
MTP drafting off (random weights accept no drafts; tests/bench/mtp_bench.py measures drafting).
`--isa native,avx2,portable` serves each variant once per instruction-set path of mixbit's kernels
(MIXBIT_KERNEL_ISA), to compare them on one CPU in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.serve_bench import Server, free_port, load_test  # noqa: E402
from tests.bench.llama_cpp import build, source_tree  # noqa: E402
from tests.bench.sizes_bench import checkpoint  # noqa: E402

CACHE = ROOT / ".cache" / "bench-cache"
GGUF = ROOT / ".cache" / "gguf"


def gguf(src: Path, folder: Path, shape: str, kind: str) -> Path:
    GGUF.mkdir(parents=True, exist_ok=True)
    bf16 = GGUF / f"{shape}-bf16.gguf"
    if not bf16.exists():
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        subprocess.run([sys.executable, "convert_hf_to_gguf.py", str(folder), "--outtype", "bf16",
                        "--outfile", str(bf16)], cwd=src, env=env, check=True)
    if kind == "bf16":
        return bf16
    out = GGUF / f"{shape}-{kind}.gguf"
    if not out.exists():
        subprocess.run([str(src / "build" / "bin" / "llama-quantize"), str(bf16), str(out), kind, "1"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def shape_checkpoint(shape: str):
    """(folder, tokenizer, logit_bias forbidding end-of-text) of a real-shape checkpoint."""
    from tokenizers import Tokenizer

    folder = checkpoint(shape)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bias = {str(tok.token_to_id(t)): -100 for t in ("<|im_end|>", "<|endoftext|>")
            if tok.token_to_id(t) is not None}
    return folder, tok, bias


def make_prompts(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["agent", "tool", "weather", "file", "read", "write", "python", "function", "call", "result",
             "error", "data", "value", "list", "city", "time", "user", "answer", "model", "server",
             "quantized", "layer", "memory", "token", "stream", "request", "json", "schema", "shell"]
    out = []
    for i in range(n):
        text = f"Request {i} {rng.randint(0, 10**9)}:"
        while len(tokenizer.encode(text).ids) < tokens:
            text += " " + " ".join(rng.choice(words) for _ in range(20))
        out.append(text)
    return out


class RssSampler:
    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                for line in open(f"/proc/{self.pid}/status"):
                    if line.startswith("VmRSS:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except OSError:
                pass
            self._stop.wait(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat (zeros where unreadable)."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])  # guest time is counted in user already


def variant_bytes(name: str, folder: Path) -> int:
    if name.endswith(".gguf"):
        return Path(name).stat().st_size
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_one(name: str, make, prompts_c1, prompts_c8, model_id: str, bias: dict, max_tokens: int,
            ready: str) -> dict:
    port = free_port()
    server = make(port)
    try:
        started = time.time()
        server.wait(ready, timeout=3600)
        ready_s = time.time() - started
        mid = model_id
        if name.startswith("mixbit"):
            import httpx

            mid = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(load_test(server.url, mid, prompts_c1[:1], 1, 4, bias))  # warm-up
        rss = RssSampler(server.proc.pid)
        steal0, total0 = cpu_times()
        c1 = asyncio.run(load_test(server.url, mid, prompts_c1, 1, max_tokens, bias))
        c8 = asyncio.run(load_test(server.url, mid, prompts_c8, 8, max_tokens, bias))
        peak = rss.stop()
        steal1, total1 = cpu_times()
        # the share of the machine's CPU time the hypervisor took during the loads: on a VM that
        # steals, a run's tok/s move with it (docs/cpu-serving.md)
        steal = (steal1 - steal0) / (total1 - total0) if total1 > total0 else None
        res = {"ready_s": ready_s, "c1": c1, "c8": c8, "rss": peak, "steal": steal}
        print(f"{name}: {res}", file=sys.stderr, flush=True)
        return res
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--variants", default="bf16,mixbit-auto",
                    help="mixbit recipes to serve (bf16, mixbit-auto, uniform-4, ...)")
    ap.add_argument("--peers", default="llama", help="comma-separated: llama, mlx_lm (slow), none")
    ap.add_argument("--llama-quants", default="Q4_K_M,bf16")
    ap.add_argument("--build-llama", action="store_true")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server flags, e.g. --llama-args=--no-repack (weights off the "
                         "repacked layouts), for a LLAMA_CPP_DIR built with AMX: such a build "
                         "(-march=native on Sapphire Rapids) crashed in ggml_backend_amx_mul_mat at "
                         "load here; --build-llama leaves AMX out")
    ap.add_argument("--isa", default="native",
                    help="comma-separated instruction sets mixbit's kernels may use, one row each: "
                         "native (all the CPU has), avx2, portable (MIXBIT_KERNEL_ISA)")
    ap.add_argument("--requests", type=int, default=4, help="requests at c=1 (c=8 sends 8)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    folder, tok, bias = shape_checkpoint(args.shape)
    prompts_c1 = make_prompts(tok, args.requests, args.prompt_tokens, seed=1)
    prompts_c8 = make_prompts(tok, 8, args.prompt_tokens, seed=8)
    # random weights accept no MTP drafts: decode without them (tests/bench/mtp_bench.py measures
    # drafting, with a replay draft)
    env_quiet = ["--set", "server.log_level='warning'", "--set", "fidelity.sample_rate=0.0",
                 "--set", f"model.cache_dir='{CACHE}'", "--set", "generation.mtp=false"]
    servers: list[tuple[str, object, str, str, Path | str]] = []
    for recipe in [v for v in args.variants.split(",") if v]:
        for isa in [i for i in args.isa.split(",") if i]:
            def make(p, recipe=recipe, isa=isa):
                return Server(f"mixbit-{recipe}-{isa}", [sys.executable, "-m", "mixbit.server.cli", "serve",
                                                         "--model", str(folder), "--recipe", recipe,
                                                         "--port", str(p), *env_quiet], p,
                              env={"MIXBIT_KERNEL_ISA": isa})
            label = f"mixbit {recipe}" + ("" if isa == "native" else f" ({isa} kernels)")
            servers.append((label, make, "", "/ready", recipe))
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    if "llama" in peers:
        src = build(("llama-server", "llama-quantize")) if args.build_llama else source_tree()
        if src is None or not (src / "build" / "bin" / "llama-server").exists():
            print("llama-server: not built (set LLAMA_CPP_DIR or pass --build-llama); skipped",
                  file=sys.stderr)
        else:
            for q in args.llama_quants.split(","):
                model = gguf(src, folder, args.shape, q)

                def make(p, model=model, src=src):
                    return Server(f"llama-{model.stem}", [
                        str(src / "build" / "bin" / "llama-server"), "-m", str(model), "-t", "2",
                        "-np", "8", "-c", str(8 * (args.prompt_tokens + args.max_tokens + 64)),
                        "--port", str(p), "--host", "127.0.0.1", *args.llama_args.split()], p)
                servers.append((f"llama-server {q}", make, model.stem, "/health", str(model)))
    if "mlx_lm" in peers:
        for recipe in [v for v in args.variants.split(",") if v]:
            path = folder if recipe == "bf16" else _variant_folder(recipe, folder)
            if path is None:
                continue

            def make(p, path=path, recipe=recipe):
                return Server(f"mlx_lm-{recipe}", [sys.executable, "-m", "mlx_lm.server", "--model",
                                                   str(path), "--port", str(p)], p)
            servers.append((f"mlx_lm.server {recipe}", make, str(path), "/health", recipe))

    results = {}
    for name, make, model_id, ready, what in servers:
        results[name] = run_one(name, make, prompts_c1, prompts_c8, model_id, bias, args.max_tokens, ready)
        if name.startswith("mixbit"):
            vf = folder if what == "bf16" else _variant_folder(str(what), folder)
            results[name]["bytes"] = variant_bytes("", vf) if vf else 0
        else:
            results[name]["bytes"] = variant_bytes(str(what), Path(str(what))) if str(what).endswith(
                ".gguf") else variant_bytes("", Path(model_id))

    print(f"\nshape {args.shape} (random weights), {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} new tokens; c=1: {args.requests} requests in turn, c=8: 8 at once\n")
    print("| server, weights | bytes | c=1 tok/s | c=1 decode tok/s/req | TTFT c=1 | c=8 tok/s | "
          "TTFT c=8 | peak RSS serving | RSS / bytes | CPU steal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        steal = "-" if r.get("steal") is None else f"{100 * r['steal']:.0f}%"
        print(f"| {name} | {r['bytes'] / 1e6:.0f} MB | {r['c1']['tok_s']:.2f} | "
              f"{r['c1']['decode_tok_s']:.2f} | {r['c1']['ttft_p50']:.2f} s | {r['c8']['tok_s']:.2f} | "
              f"{r['c8']['ttft_p50']:.2f} s | {r['rss'] / 1e9:.2f} GB | "
              f"{r['rss'] / max(r['bytes'], 1):.2f} | {steal} |")
    print("\nCPU steal: the share of all CPU time the hypervisor took during that server's loads "
          "(/proc/stat); compare rows run under similar steal.")
    return 0


def _variant_folder(recipe: str, source: Path) -> Path | None:
    """The cached variant of `source` for `recipe` (newest recipe.json naming both)."""
    import json

    found = []
    for f in (CACHE / "variants").glob("*/recipe.json"):
        try:
            r = json.loads(f.read_text())
            model = Path(str((r.get("source") or {}).get("model", "")))
            if r.get("recipe") == recipe and (ROOT / model).resolve() == source.resolve():
                found.append((f.stat().st_mtime, f.parent))
        except (OSError, ValueError):
            continue
    return max(found)[1] if found else None


if __name__ == "__main__":
    raise SystemExit(main())
