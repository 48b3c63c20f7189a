"""Where a served variant's memory goes, at a real Qwen3.5 shape: resident memory (RSS), MLX's
live arrays, MLX's buffer cache and the prefix cache, read from the server's own /metrics every
0.2 s: when ready, at the peak of a c=1 load, at the peak of a c=8 load and after it; and the
peak resident memory of loading (the process's VmHWM when it turns ready).

    .venv/bin/python tests/bench/serve_memory.py [--shape 0.8b] [--recipe mixbit-auto]

The checkpoint and the variant are the ones tests/bench/kernel_serve_bench.py uses (random
weights in .cache/shapes/<shape>, the variant quantized into .cache/bench-cache at its first
start). Load: distinct ~300-token prompts, 32 new tokens, 2 requests in turn, then 8 at once.
Memory does not depend on how busy the machine is; the tok/s printed beside it does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.kernel_serve_bench import CACHE, make_prompts, shape_checkpoint  # noqa: E402
from tests.bench.serve_bench import Server, free_port, load_test  # noqa: E402
from tests.server_proc import metric_value  # noqa: E402

GAUGES = {"rss": "mixbit_memory_bytes", "mlx active": "mixbit_mlx_active_memory_bytes",
          "mlx cache": "mixbit_mlx_cache_memory_bytes", "prefix cache": "mixbit_prefix_cache_bytes"}


class Poller:
    """Samples the gauges; `mark()` closes a phase and returns its peaks and last values."""

    def __init__(self, url: str):
        import httpx

        self._get = lambda: httpx.get(url + "/metrics", timeout=10).text
        self._peak: dict[str, float] = {}
        self._now: dict[str, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sample()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def sample(self):
        text = self._get()
        with self._lock:
            for key, name in GAUGES.items():
                v = metric_value(text, name)
                self._now[key] = v
                self._peak[key] = max(self._peak.get(key, 0.0), v)

    def _run(self):
        while not self._stop.wait(0.2):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a slow scrape under load: the next one counts
                pass

    def mark(self) -> tuple[dict, dict]:
        self.sample()
        with self._lock:
            peak, now = dict(self._peak), dict(self._now)
            self._peak = dict(self._now)
        return peak, now

    def stop(self):
        self._stop.set()
        self._t.join()


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--recipe", default="mixbit-auto")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import httpx

    folder, tok, bias = shape_checkpoint(args.shape)
    port = free_port()
    server = Server(f"mixbit-{args.recipe}", [
        sys.executable, "-m", "mixbit.server.cli", "serve", "--model", str(folder), "--recipe", args.recipe,
        "--port", str(port), "--set", "server.log_level='warning'", "--set", "fidelity.sample_rate=0.0",
        "--set", f"model.cache_dir='{CACHE}'"], port)
    rows = []
    try:
        started = time.time()
        server.wait("/ready", timeout=3600)
        ready_s = time.time() - started
        mid = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        load_peak = _hwm(server.proc.pid)  # the process's peak resident memory so far: loading
        poll = Poller(server.url)
        rows.append(("ready", *poll.mark(), f"{ready_s:.0f} s to ready; loading peaked at "
                                            f"{load_peak / 1e6:,.0f} MB resident"))
        c1 = asyncio.run(load_test(server.url, mid, make_prompts(tok, 2, 300, seed=1), 1, args.max_tokens, bias))
        rows.append(("c=1 load", *poll.mark(), f"{c1['decode_tok_s']:.2f} decode tok/s"))
        c8 = asyncio.run(load_test(server.url, mid, make_prompts(tok, 8, 300, seed=8), 8, args.max_tokens, bias))
        rows.append(("c=8 load", *poll.mark(), f"{c8['tok_s']:.2f} tok/s"))
        time.sleep(2)
        peak, now = poll.mark()
        rows.append(("after the loads", now, now, ""))
        poll.stop()
    finally:
        server.stop()

    mb = lambda v: f"{v / 1e6:,.0f}"  # noqa: E731
    print(f"\nshape {args.shape} (random weights), {args.recipe}; MB (peak in the phase; the last "
          "row: values then)\n")
    print("| phase | RSS | MLX arrays | MLX buffer cache | prefix cache | |")
    print("|---|---|---|---|---|---|")
    for name, peak, _now, note in rows:
        print(f"| {name} | {mb(peak.get('rss', 0))} | {mb(peak.get('mlx active', 0))} | "
              f"{mb(peak.get('mlx cache', 0))} | {mb(peak.get('prefix cache', 0))} | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
