"""Sensitivity that scales: measured layer by layer, forward passes only, within a time budget.

What the exact ablation measures - the KL divergence of the model's next-token distribution when
one tensor alone is quantized - is split into two factors:

- how much a format disturbs the tensor's *output* on real inputs: the activation-weighted error
  E(t, f) = sum_j imp_j * sum_i (W - Q_f(W))_ij^2, with imp_j the mean square of input channel j
  on the calibration tokens (llama.cpp's importance matrix); for a stack of routed experts, each
  expert's rows under its own importance (the inputs routed to it, weighted by the squared routing
  weight, per token: `stream.Recorder.observe`). It costs one fake-quantization per (tensor,
  format) and no forward pass; it orders the formats of one tensor.
- how much that output disturbance moves the final distribution: alpha(t) = KLD / E, measured by
  a *probe*, the exact ablation at one format (4 bits), run from the tensor's own layer onwards
  on a few calibration rows whose layer inputs were kept from the first pass.

KLD(t, f) ~ alpha(t) * E(t, f). Probes are spent in order of information (every tensor class at
its middle layer, then first and last layers, then halving the gaps) while the budget lasts;
a tensor left unprobed takes the alpha of its class interpolated over depth (log-linear). With
budget to spare, further waves probe every tensor at 6 and then 3 bits: a tensor with two or more
anchors gets its KLD from the error by straight lines in log-log between them (the error-to-KLD
curve is not quite proportional: on the embedded model, one 4-bit anchor cost 11% more held-out
KLD at 4.5 bits per weight than the exact ablation). With budget for every (tensor, bits) pair
the exact ablation is run instead (`method = "ablation"`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .formats import BITS, Format, cpu_streams, fake_quantize, formats_for, tensor_class
from .progress import Progress
from .sensitivity import SensitivityTable, layer_of
from .stream import ChunkedFakeQuant, LayerStream, _get_child as _child

PROBE_BITS = 4
EXTRA_ANCHORS = (6, 3)  # second and third probe waves: the error-to-KLD curve between them
REF_BYTES = 256 << 20  # reference log-probabilities kept for probes (rows x vocabulary x 4 bytes)
ROW_CHUNK = 32768  # rows of a big tensor fake-quantized at a time
ERROR_ELEMENTS = 4096 * 1024  # weights of a tensor its activation-weighted error is measured on
ERROR_ROWS_MIN = 1024  # ... in at least this many rows


class LayerInputs:
    """The probe rows' hidden states entering each layer: in memory, or with `folder` one file
    per layer, read back when a probe starts there (memory then does not grow with depth)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder
        self.items: list = []

    def append(self, h: mx.array) -> None:
        if self.folder is None:
            self.items.append(h)
            return
        path = self.folder / f"layer-input-{len(self.items):04d}.safetensors"
        mx.save_safetensors(str(path), {"h": h})
        self.items.append(path)

    def __getitem__(self, i: int) -> mx.array:
        item = self.items[i]
        return item if isinstance(item, mx.array) else mx.load(str(item))["h"]

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class FirstPass:
    """What one forward pass over the calibration rows leaves for the probes and the errors."""
    imp: dict[str, mx.array]  # tensor path -> mean square of each input channel
    inputs: LayerInputs  # hidden states entering layer l (l = 0..L), probe rows only
    ref: mx.array  # reference log-probabilities of the probe rows, [tokens, vocab]
    probe_rows: mx.array
    rows_total: int = 1
    layer_seconds: list[float] = field(default_factory=list)
    head_seconds: float = 0.0


def probe_row_count(stream: LayerStream, rows: mx.array) -> int:
    per_row = rows.shape[1] * stream.vocab * 4
    return max(1, min(rows.shape[0], REF_BYTES // per_row))


def first_pass(stream: LayerStream, rows: mx.array, progress: Progress | None = None,
               spill: Path | None = None) -> FirstPass:
    """`spill`: a folder for the per-layer probe inputs (else they stay in memory)."""
    n_probe = probe_row_count(stream, rows)
    record: dict = {}
    h = stream.embed(rows)
    inputs = LayerInputs(spill)
    first = mx.array(h[:n_probe])
    mx.eval(first)
    inputs.append(first)
    seconds = []
    n = len(stream.layers)
    if progress:
        progress.stage("activations", n, f"{rows.shape[0]}x{rows.shape[1]} calibration tokens")
    for i in range(n):
        t = time.time()
        h = stream.run_layer(i, h, record)
        nxt = mx.array(h[:n_probe])
        mx.eval(nxt)
        inputs.append(nxt)
        seconds.append(time.time() - t)
        if progress:
            progress.step(i + 1)
    normed = stream.final_norm(h)
    flat = normed.reshape(-1, normed.shape[-1])
    head_imp = (flat * flat).mean(axis=0)
    t = time.time()
    ref = stream.logprobs(normed[:n_probe].reshape(-1, normed.shape[-1]))
    head_s = time.time() - t
    imp = {p: sq / count for p, (sq, count) in record.items()}
    imp[stream.head_path] = head_imp  # the head's input: final normed hidden states
    if not stream.tied:  # untied embeddings: rows weighted by how often their token occurs
        counts = mx.zeros((stream.vocab,), dtype=mx.float32).at[rows.reshape(-1)].add(1.0)
        imp[f"{stream.prefix}.embed_tokens"] = counts / rows.size
    mx.eval(imp)
    return FirstPass(imp=imp, inputs=inputs, ref=ref, probe_rows=rows[:n_probe],
                     rows_total=rows.shape[0], layer_seconds=seconds, head_seconds=head_s)


def weighted_errors(w, fmts: list[Format], imp: mx.array, by_row: bool = False,
                    streams: int = 2) -> dict[str, float]:
    """E(t, f) for each format f: squared quantization error weighted by input-channel
    importance (or, for an untied embedding, by row frequency). Quantization groups run along a
    row, so a tensor with more than ERROR_ELEMENTS weights is estimated from every k-th row
    (scaled back up), sampled once for all formats: the 248k-row embedding and a 17k-wide
    projection cost what a 4M-weight one does, and the ratios between formats, which is what the
    estimator uses, come from the same rows."""
    n_rows = math.prod(w.shape[:-1])
    stride = max(1, -(-n_rows // max(ERROR_ROWS_MIN, ERROR_ELEMENTS // w.shape[-1])))
    if isinstance(w, mx.array):
        flat = w.reshape(-1, w.shape[-1])[::stride]
    else:  # rows of a table on disk (quant/checkpoint.Rows): only the sampled ones are read
        flat = w[::stride]
    mx.eval(flat)
    per_expert = imp.ndim == 2  # a stack of routed experts [E, out, in]: each row its expert's importance
    if per_expert:
        imp = imp[(mx.arange(flat.shape[0]) * stride) // w.shape[-2]]
        mx.eval(imp)
    elif stride > 1:
        imp = imp[::stride] if by_row else imp
    # formats side by side on `streams` CPU streams, a pair's temporaries at a time; the same sums
    # as one after the other
    streams = cpu_streams(streams)
    out = {}
    for k in range(0, len(fmts), len(streams)):
        sums = {}
        for fmt, stream in zip(fmts[k:k + len(streams)], streams):
            with mx.stream(stream):
                sums[fmt.name] = []
                for start in range(0, flat.shape[0], ROW_CHUNK):
                    chunk = flat[start:start + ROW_CHUNK]
                    d = chunk.astype(mx.float32) - fake_quantize(chunk, fmt).astype(mx.float32)
                    sq = d * d
                    if by_row:
                        sums[fmt.name].append((sq.sum(axis=1) * imp[start:start + ROW_CHUNK]).sum())
                    elif per_expert:
                        sums[fmt.name].append((sq * imp[start:start + ROW_CHUNK]).sum())
                    else:
                        sums[fmt.name].append((sq.sum(axis=0) * imp).sum())
        mx.eval(sums)
        for name, parts in sums.items():
            out[name] = sum(float(p.item()) for p in parts) * n_rows / flat.shape[0]
    return out


def probe_kld(stream: LayerStream, fp: FirstPass, path: str, module: nn.Module, fmt: Format) -> float:
    """The exact ablation of one (tensor, format) on the probe rows. The embedding table and
    the head are quantized where they are read (looked-up rows, head chunks): a 248k-row table
    is never copied whole."""
    start = layer_of(path)
    rel = path.split(".layers.", 1)[1].split(".", 1)[1] if ".layers." in path else None
    if path.endswith("embed_tokens"):
        h, first = stream.embed(fp.probe_rows, fmt), 0
    elif start == 0:
        h, first = stream.embed(fp.probe_rows), 0
    else:
        first = min(start, len(stream.layers))
        h = fp.inputs[first]
    for i in range(first, len(stream.layers)):
        h = stream.run_layer(i, h, fake={rel: fmt} if rel is not None and i == start else None)
    normed = stream.final_norm(h).reshape(-1, h.shape[-1])
    head = ChunkedFakeQuant(stream.head_weight(), fmt) if path == stream.head_path else None
    kld = float(stream.compare(fp.ref, normed, head)[0].mean().item())
    return max(kld, 0.0)


def probe_format(shape) -> Format:
    n_in = shape[-1]
    return Format(PROBE_BITS, 64 if n_in % 64 == 0 else 32)


def probe_order(paths: list[str]) -> list[str]:
    """Tensors in the order a probe teaches most: outer tensors, each class at its middle
    layer, then at its first and last, then halving the gaps, round-robin over classes."""
    by_class: dict[str, list[str]] = {}
    outer = []
    for p in paths:
        if "layers" not in p.split("."):
            outer.append(p)
        else:
            by_class.setdefault(tensor_class(p), []).append(p)
    waves: list[list[str]] = []
    for members in by_class.values():
        members.sort(key=layer_of)
        chosen: list[int] = []
        order = []

        def take(i):
            if 0 <= i < len(members) and i not in chosen:
                chosen.append(i)
                order.append(members[i])

        take(len(members) // 2)
        take(0)
        take(len(members) - 1)
        while len(chosen) < len(members):
            idx = sorted(chosen)
            gaps = sorted(((b - a, a, b) for a, b in zip(idx, idx[1:]) if b - a > 1), reverse=True)
            if not gaps:
                break
            for _, a, b in gaps:
                take((a + b) // 2)
        for wave, p in enumerate(order):
            while len(waves) <= wave:
                waves.append([])
            waves[wave].append(p)
    return outer + [p for wave in waves for p in wave]


class CostModel:
    """Seconds of a probe that runs `layers` decoder layers and the head, from probes so far."""

    def __init__(self, fp: FirstPass, probe_fraction: float):
        per_layer = sum(fp.layer_seconds) / max(len(fp.layer_seconds), 1) * probe_fraction
        self.samples: list[tuple[int, float]] = []
        self.prior = (per_layer, fp.head_seconds)

    def add(self, layers: int, seconds: float) -> None:
        self.samples.append((layers, seconds))

    def predict(self, layers: int) -> float:
        per_layer, fixed = self.prior
        if self.samples:
            # scale the prior by how the probes so far compared with it
            ratio = sum(s for _, s in self.samples) / max(
                sum(per_layer * n + fixed for n, _ in self.samples), 1e-9)
            per_layer, fixed = per_layer * ratio, fixed * ratio
        return per_layer * layers + fixed


def estimate(stream: LayerStream, fp: FirstPass, budget_s: float, *, bits: tuple[int, ...] = BITS,
             exact_all_bits: bool = False, progress: Progress | None = None,
             saved: dict | None = None, on_save=None) -> SensitivityTable:
    """The table: probes within `budget_s` (all (tensor, bits) pairs exact with
    `exact_all_bits`), activation-weighted errors for every format. `saved` is what an earlier,
    interrupted run measured ({"probes": {path: {format: kld}}, "errors": {path: {format: e}},
    "probe_seconds": s}); the budget counts the seconds it already spent. `on_save(saved)` is
    called after each probe and each tensor's errors, so the caller can keep them."""
    modules = stream.all_tensors()
    n_layers = len(stream.layers)
    saved = {"probes": {p: dict(v) for p, v in (saved or {}).get("probes", {}).items()},
             "errors": {p: dict(v) for p, v in (saved or {}).get("errors", {}).items()},
             "probe_seconds": float((saved or {}).get("probe_seconds", 0.0))}
    done = saved["probes"]
    paths = probe_order(list(modules))
    probes: list[tuple[str, Format]] = []
    if exact_all_bits:
        for p in paths:
            g = probe_format(modules[p].weight.shape).group_size
            probes += [(p, Format(b, g)) for b in bits]
    else:  # waves: every tensor at 4 bits, then (time permitting) at 6 and 3 bits as anchors
        for b in [PROBE_BITS] + [b for b in EXTRA_ANCHORS if b in bits]:
            probes += [(p, Format(b, probe_format(modules[p].weight.shape).group_size)) for p in paths]
    cost = CostModel(fp, fp.probe_rows.shape[0] / fp.rows_total)
    started = time.time() - saved["probe_seconds"]
    if progress:
        progress.stage("sensitivity", len(probes), f"probes within {budget_s:.0f}s")
    measured = sum(len(v) for v in done.values())
    for k, (path, fmt) in enumerate(probes):
        if fmt.name in done.get(path, {}):
            continue
        layers = n_layers - min(layer_of(path), n_layers) if not path.endswith("embed_tokens") else n_layers
        if not exact_all_bits and measured and time.time() - started + cost.predict(layers) > budget_s:
            break
        t = time.time()
        done.setdefault(path, {})[fmt.name] = probe_kld(stream, fp, path, modules[path], fmt)
        cost.add(layers, time.time() - t)
        measured += 1
        saved["probe_seconds"] = time.time() - started
        if on_save:
            on_save(saved)
        if progress:
            total = len(probes)
            if not exact_all_bits:  # as many as the rest of the budget is predicted to allow
                left = budget_s - (time.time() - started)
                total = min(total, k + 1 + max(0, int(left / max(cost.predict(n_layers // 2), 1e-3))))
            progress.step(k + 1, total=total, message=path.rsplit(".layers.", 1)[-1])
    seconds = time.time() - started
    errors = saved["errors"]
    if progress:
        progress.stage("errors", len(modules), "activation-weighted quantization error per format")
    k = 0
    for i, group in _by_layer(stream, modules):  # one read of each layer for all its tensors
        todo = [p for p in group if p not in errors]
        with (stream.layer(i) if todo and i is not None else _nothing()) as layer:
            for path in group:
                if path not in errors:
                    w = (stream.rows(path) if i is None else
                         _child(layer, path.split(".layers.", 1)[1].split(".", 1)[1]).weight)
                    imp = fp.imp.get(path)
                    if imp is None:  # never reached by the calibration tokens
                        imp = mx.ones((w.shape[-1],), dtype=mx.float32)
                    by_row = path.endswith("embed_tokens") and not stream.tied
                    errors[path] = weighted_errors(w, [f for f in formats_for(w.shape[-1]) if f.bits in bits],
                                                   imp, by_row=by_row)
                    if on_save:
                        on_save(saved)
                k += 1
                if progress:
                    progress.step(k)
    return _table(modules, done, errors, bits, exact_all_bits, budget_s, seconds, fp)


def _by_layer(stream: LayerStream, modules: dict) -> list[tuple[int | None, list[str]]]:
    """Tensor paths grouped by decoder layer (None: outside the layers), in layer order."""
    groups: dict = {}
    for path in modules:
        groups.setdefault(layer_of(path) if ".layers." in path else None, []).append(path)
    return sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


@contextmanager
def _nothing():
    yield None


def _table(modules, done, errors, bits, exact_all_bits, budget_s, seconds, fp) -> SensitivityTable:
    table = SensitivityTable(kld={}, params={}, shapes={})
    alphas: dict[str, float] = {}
    for path, module in modules.items():
        w = module.weight
        table.params[path], table.shapes[path] = int(w.size), list(w.shape)
        measured = sorted(done.get(path, {}).items(), key=lambda kv: Format.parse(kv[0]).bits != PROBE_BITS)
        for name, kld in measured:  # the 4-bit probe, when there is one, sets alpha
            e = errors[path].get(name, 0.0)
            if e > 0:
                alphas.setdefault(path, kld / e)
    interpolated = _interpolate(alphas, list(modules))
    for path in modules:
        a = alphas.get(path, interpolated.get(path, 0.0))
        table.kld[path], table.estimated[path] = {}, []
        anchors = sorted((errors[path][m], k) for m, k in done.get(path, {}).items()
                         if errors[path].get(m, 0) > 0 and k > 0)
        for name, e in errors[path].items():
            if name in done.get(path, {}):
                table.kld[path][name] = done[path][name]
                continue
            # the same bit width measured at another group size: scale by the error ratio
            # (tightest); else the log-log curve through the anchors; else proportional
            same = [m for m in done.get(path, {}) if Format.parse(m).bits == Format.parse(name).bits]
            if same and errors[path].get(same[0], 0) > 0:
                table.kld[path][name] = done[path][same[0]] * e / errors[path][same[0]]
            else:
                table.kld[path][name] = _from_anchors(anchors, e) if len(anchors) >= 2 else a * e
            table.estimated[path].append(name)
    probed = sorted(done)
    table.meta = {"method": "ablation" if exact_all_bits else "probe",
                  "description": ("exact ablation of every (tensor, bits) pair at group 64, other "
                                  "group sizes scaled by activation-weighted error") if exact_all_bits
                  else ("probe: exact ablation of probed tensors at 4 bits (then 6 and 3 while "
                        "the budget lasts); other formats from the activation-weighted error, "
                        "log-log between a tensor's anchors or proportional to one; unprobed "
                        "tensors take their class's alpha interpolated over depth"),
                  "probes": len(probed), "tensors": len(modules), "budget_s": budget_s,
                  "seconds": round(seconds, 1), "probe_tokens": int(fp.ref.shape[0]),
                  "bits": list(bits), "alpha": {p: alphas[p] for p in probed if p in alphas}}
    return table


def _from_anchors(anchors: list[tuple[float, float]], e: float) -> float:
    """KLD at error e from measured (error, KLD) anchors: straight lines in log-log between
    them, the nearest segment's slope beyond them (kept within [0.5, 2])."""
    if e <= 0:
        return 0.0
    x = math.log(e)
    pts = [(math.log(ea), math.log(ka)) for ea, ka in anchors]
    i = next((j for j in range(1, len(pts)) if x <= pts[j][0]), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 1.0
    if not pts[0][0] <= x <= pts[-1][0]:
        slope = min(max(slope, 0.5), 2.0)
    return math.exp(y0 + slope * (x - x0))


def _interpolate(alphas: dict[str, float], paths: list[str]) -> dict[str, float]:
    """alpha of unprobed tensors: log-linear over depth between the probed ones of their class;
    the class's nearest probe beyond the ends; the geometric mean of all probes otherwise."""
    by_class: dict[str, list[tuple[int, float]]] = {}
    for p, a in alphas.items():
        if a > 0:
            by_class.setdefault(tensor_class(p), []).append((layer_of(p), math.log(a)))
    everything = [v for pts in by_class.values() for _, v in pts]
    fallback = math.exp(sum(everything) / len(everything)) if everything else 0.0
    out = {}
    for p in paths:
        if p in alphas:
            continue
        pts = sorted(by_class.get(tensor_class(p), []))
        if not pts:
            out[p] = fallback
            continue
        x = layer_of(p)
        lo = [pt for pt in pts if pt[0] <= x]
        hi = [pt for pt in pts if pt[0] >= x]
        if lo and hi and hi[0][0] != lo[-1][0]:
            (x0, y0), (x1, y1) = lo[-1], hi[0]
            out[p] = math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
        else:
            out[p] = math.exp((lo[-1] if lo else hi[0])[1])
    return out
