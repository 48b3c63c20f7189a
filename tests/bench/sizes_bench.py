"""First start at real Qwen3.5 sizes: time per stage, peak memory, variant bytes, resume after
kill -9, and a short serving check. Random weights in the published layout (real_shapes.py):
they measure time and memory, not quality.

    .venv/bin/python tests/bench/sizes_bench.py --shapes 0.8b,2b,35b-a3b-reduced [--resume]
    .venv/bin/python tests/bench/sizes_bench.py --shapes 9b-4l,9b-8l,27b-4l,27b-8l --no-serve

For each shape: writes the checkpoint once (.cache/shapes/<shape>), runs `mixbit quantize`
(mixbit-auto, defaults) under /usr/bin/time -v into a fresh cache, and reads the stages from
recipe.json. With --resume, a second fresh cache gets a first start killed with SIGKILL at half
the measured time and then restarted: the restart's time against the full run's. Then `mixbit
serve` on the cached variant: ready time, and c=1 time to first token and decode tokens/s over a
few 300-token prompts (serving speed at real size has its own benchmark, serve_bench.py).
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES_DIR = ROOT / ".cache" / "shapes"
MIXBIT = [sys.executable, "-m", "mixbit.server.cli"]


def checkpoint(shape: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.bench.real_shapes import write_checkpoint

    out = SHAPES_DIR / shape
    if not (out / "config.json").is_file():
        write_checkpoint(shape, out)
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _anon_kb(pid: int) -> int:
    """RssAnon of a process and its descendants (kB): memory the kernel cannot drop, unlike
    the file-backed pages of a memory-mapped checkpoint that RSS counts too."""
    total = 0
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                total += int(line.split()[1])
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                total += _anon_kb(int(child))
    except (OSError, ValueError):
        pass
    return total


def largest_layer_gb(folder: Path) -> float:
    """The largest decoder layer's bytes as stored (bf16), from the safetensors headers."""
    sys.path.insert(0, str(ROOT))
    from mixbit.quant.checkpoint import Checkpoint

    ck = Checkpoint(folder)
    per: dict = {}
    for name, e in ck.entries.items():
        parts = name.split(".")
        if name.startswith("model.language_model.layers."):
            per[parts[3]] = per.get(parts[3], 0) + e.nbytes
    return max(per.values()) / 1e9


def quantize(folder: Path, cache: Path, log: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", *MIXBIT, "quantize", "--model", str(folder),
           "--set", f"model.cache_dir='{cache}'"]
    started = time.time()
    peak_anon = 0
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        while proc.poll() is None:  # sampled 5 times a second
            peak_anon = max(peak_anon, _anon_kb(proc.pid))
            time.sleep(0.2)
        rc = proc.returncode
    wall = time.time() - started
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    out = {"rc": rc, "wall_s": wall, "peak_rss_gb": int(rss.group(1)) / 1e6 if rss else None,
           "peak_anon_gb": peak_anon / 1e6}
    line = next((ln for ln in text.splitlines() if ln.startswith("{\"path\"")), None)
    if line:
        info = json.loads(line)
        recipe = json.loads((Path(info["path"]) / "recipe.json").read_text())
        out.update(path=info["path"], bytes=recipe["bytes"], bpw=recipe["bits_per_weight"],
                   stages=recipe.get("stages_s", {}), method=recipe.get("sensitivity_method"),
                   stages_anon_gb=recipe.get("stages_peak_anon_gb", {}),
                   memory_plan=recipe.get("memory_plan", {}),
                   probes=recipe.get("sensitivity_probes"), kld=recipe.get("measured_kld"))
    return out


def killed_then_resumed(folder: Path, full_s: float, log: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="mixbit-resume-"))
    cmd = [*MIXBIT, "quantize", "--model", str(folder), "--set", f"model.cache_dir='{cache}'"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        time.sleep(full_s / 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    started = time.time()
    with open(log, "a") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT).returncode
    second = time.time() - started
    shutil.rmtree(cache, ignore_errors=True)
    return {"rc": rc, "second_s": second, "ratio": second / full_s}


def serve_check(folder: Path, cache: Path, log: Path, n: int = 3) -> dict:
    import httpx

    port = 18000 + os.getpid() % 1000
    cmd = [*MIXBIT, "serve", "--model", str(folder), "--port", str(port),
           "--set", f"model.cache_dir='{cache}'", "--set", "fidelity.enabled=false"]
    started = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - started > 1800:
                return {"ready_s": None}
            time.sleep(0.5)
        ready = time.time() - started
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        prompt = " ".join(f"item {i} is on the list;" for i in range(60))  # ~300 tokens
        ttfts, rates = [], []
        for i in range(n):
            t0 = time.time()
            first = None
            tokens = 0
            with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                    "model": model, "prompt": f"{i} {prompt}", "max_tokens": 32, "temperature": 0,
                    "stream": True, "logit_bias": {}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if first is None:
                            first = time.time()
                        tokens += 1
            end = time.time()
            ttfts.append(first - t0)
            rates.append((tokens - 1) / max(end - first, 1e-9))
        rss = int(open(f"/proc/{proc.pid}/status").read().split("VmRSS:")[1].split()[0]) / 1e6
        return {"ready_s": ready, "ttft_s": sorted(ttfts)[n // 2], "decode_tok_s": sorted(rates)[n // 2],
                "rss_gb": rss}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.8b,2b")
    ap.add_argument("--resume", action="store_true", help="also kill -9 a first start at half time")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--delete", action="store_true", help="remove each written checkpoint after its "
                    "row (the big shapes take 6-18 GB of disk each)")
    ap.add_argument("--table", action="store_true", help="only print the table of the rows saved by "
                    "earlier runs (.cache/sizes-bench/rows.json)")
    args = ap.parse_args()
    logs = ROOT / ".cache" / "sizes-bench"
    logs.mkdir(parents=True, exist_ok=True)
    saved_rows = logs / "rows.json"
    try:
        kept = json.loads(saved_rows.read_text())
    except (OSError, ValueError):
        kept = {}
    if args.table:
        return _print([kept[s] for s in args.shapes.split(",") if s in kept])
    rows = []
    for shape in args.shapes.split(","):
        folder = checkpoint(shape)
        ckpt_gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        cache = Path(tempfile.mkdtemp(prefix=f"mixbit-{shape}-"))
        q = quantize(folder, cache, logs / f"{shape}-quantize.log")
        row = {"shape": shape, "checkpoint_gb": ckpt_gb, "layer_gb": largest_layer_gb(folder), **q}
        print(f"{shape}: {json.dumps(row)}", flush=True)
        if args.resume and q["rc"] == 0:
            row["resume"] = killed_then_resumed(folder, q["wall_s"], logs / f"{shape}-resume.log")
            print(f"{shape} resume: {row['resume']}", flush=True)
        if not args.no_serve and q["rc"] == 0:
            row["serve"] = serve_check(folder, cache, logs / f"{shape}-serve.log")
            print(f"{shape} serve: {row['serve']}", flush=True)
        shutil.rmtree(cache, ignore_errors=True)
        if args.delete:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append(row)
        kept[shape] = row
        saved_rows.write_text(json.dumps(kept, indent=1))
    _print(rows)


def _print(rows: list[dict]) -> None:
    print("\n| shape | checkpoint | first start | stages (s) | peak anonymous (sampled) | target: 3 GB + "
          "largest layer | peak RSS (incl. mapped file) | variant | bits/weight | sensitivity | "
          "killed at half, restart | serve: ready / TTFT / decode / RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = r.get("stages", {})
        stages = ", ".join(f"{k} {st[k]:.0f}" for k in sorted(st, key=lambda k: (STAGES + (k,)).index(k)))
        res = r.get("resume")
        resume = f"{res['second_s']:.0f} s ({100 * res['ratio']:.0f}%)" if res else "-"
        s = r.get("serve") or {}
        serve = (f"{s['ready_s']:.0f} s / {s['ttft_s']:.2f} s / {s['decode_tok_s']:.1f} tok/s / "
                 f"{s['rss_gb']:.2f} GB") if s.get("ready_s") else "-"
        target = 3 + r["layer_gb"]
        print(f"| {r['shape']} | {r['checkpoint_gb']:.2f} GB | {r['wall_s']:.0f} s | {stages} | "
              f"**{r['peak_anon_gb']:.2f} GB** | {target:.2f} GB "
              f"({'met' if r['peak_anon_gb'] <= target else 'NOT met'}) | {r['peak_rss_gb']:.2f} GB | "
              f"{r.get('bytes', 0) / 1e9:.3f} GB | {r.get('bpw', 0):.2f} | "
              f"{r.get('method')} ({r.get('probes')} probes) | {resume} | {serve} |")
    _depth_table(rows)
    _stage_table(rows)


STAGES = ("calibration", "activations", "sensitivity", "errors", "allocation", "awq+write", "checking")


def _stage_table(rows: list[dict]) -> None:
    """Each stage's sampled peak anonymous memory beside the plan made before any work."""
    rows = [r for r in rows if r.get("stages_anon_gb")]
    if not rows:
        return
    print("\n| shape | planned | " + " | ".join(STAGES) + " |")
    print("|---|---|" + "---|" * len(STAGES))
    for r in rows:
        plan = r.get("memory_plan", {}).get("planned_gb")
        cells = [f"{r['stages_anon_gb'][k]:.2f}" if k in r["stages_anon_gb"] else "-" for k in STAGES]
        print(f"| {r['shape']} | {plan if plan is not None else '-'} | " + " | ".join(cells) + " |")


FULL_DEPTH = {"9b": 32, "27b": 64, "35b-a3b": 40}


def _depth_table(rows: list[dict]) -> None:
    """Shapes run at 4 and 8 layers: memory growth with depth, seconds per layer (the difference
    over 4 layers), and the first start extrapolated to the published depth."""
    by = {r["shape"]: r for r in rows if r.get("rc") == 0}
    lines = []
    for model, depth in FULL_DEPTH.items():
        a, b = by.get(f"{model}-4l"), by.get(f"{model}-8l")
        if not (a and b):
            continue
        per = (b["wall_s"] - a["wall_s"]) / 4  # the marginal cost of a layer
        growth = b["peak_anon_gb"] / a["peak_anon_gb"] - 1
        lines.append(f"| {model} | {a['peak_anon_gb']:.2f} / {b['peak_anon_gb']:.2f} GB ({100 * growth:+.0f}%) | "
                     f"{a['wall_s']:.0f} / {b['wall_s']:.0f} s | {per:.0f} s | {depth} | "
                     f"**{(b['wall_s'] + (depth - 8) * per) / 60:.0f} min** |")
    if lines:
        print("\n| model | peak anonymous 4 / 8 layers | first start 4 / 8 layers | seconds per layer | "
              "full depth | first start extrapolated (8 layers + the rest at the per-layer cost) |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
