"""Streamed quantization: layer by layer, resumable, MoE and the extras published checkpoints
carry, progress while it runs. Small shapes with the real structure (tests/bench/real_shapes.py);
the real sizes are measured by tests/bench/sizes_bench.py."""

from __future__ import annotations

import json
import time

import httpx
import mlx.core as mx
import pytest

from mixbit.models.registry import resolve
from mixbit.quant import artifact
from mixbit.quant.progress import Progress
from mixbit.quant.variants import ensure_variant

from .bench.real_shapes import write_checkpoint
from .server_proc import ServerProcess
from .test_server_api import ask


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint("tiny-moe", tmp_path_factory.mktemp("moe") / "ckpt")


def _weights(folder) -> dict[str, mx.array]:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def test_a_crash_mid_write_resumes_after_the_last_layer(tmp_path, tiny_dense, monkeypatch):
    from mixbit.quant import writer

    clean = ensure_variant(resolve(str(tiny_dense)), "unsloth-static", cache_dir=str(tmp_path / "a"))
    real_flush = writer._Shards.flush
    calls = []

    def dying_flush(self):
        calls.append(1)
        if len(calls) == 3:  # the outer tensors and layer 0 are on disk
            raise OSError("killed")
        return real_flush(self)

    monkeypatch.setattr(writer._Shards, "flush", dying_flush)
    with pytest.raises(OSError):
        ensure_variant(resolve(str(tiny_dense)), "unsloth-static", cache_dir=str(tmp_path / "b"))
    variants = tmp_path / "b" / "variants"
    assert [p for p in variants.iterdir() if not p.name.startswith(".")] == []  # nothing to serve
    (partial,) = [p for p in variants.iterdir() if p.name.endswith(".partial")]
    assert json.loads((partial / writer.STATE).read_text())["next_layer"] == 1
    monkeypatch.setattr(writer._Shards, "flush", real_flush)
    said = []
    resumed = ensure_variant(resolve(str(tiny_dense)), "unsloth-static", cache_dir=str(tmp_path / "b"),
                             progress=said.append)
    assert any("resuming at layer 1 of 4" in s for s in said), said
    assert artifact.verify(resumed.path) is None and not partial.exists()
    a, b = _weights(clean.path), _weights(resumed.path)
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)  # the same variant, bit for bit
    ra = json.loads((clean.path / "recipe.json").read_text())
    rb = json.loads((resumed.path / "recipe.json").read_text())
    assert ra["measured_kld"] == pytest.approx(rb["measured_kld"], rel=1e-5)
    assert ra["awq"] == rb["awq"]


def test_interrupted_sensitivity_keeps_its_probes(tiny_dense):
    from mixbit.quant import calibration as calib
    from mixbit.quant import probe as probe_mod
    from mixbit.quant.stream import LayerStream
    from mlx_lm.utils import load_tokenizer

    cal = calib.build(load_tokenizer(tiny_dense), n_rows=4, length=32)
    stream = LayerStream(tiny_dense)
    fp = probe_mod.first_pass(stream, cal.rows)
    full = probe_mod.estimate(stream, fp, 1e9, bits=(3, 4), exact_all_bits=True)
    saved = {}

    def stop_after_five(measured):
        saved.clear()
        saved.update(json.loads(json.dumps(measured)))  # what a file on disk would hold
        if sum(len(v) for v in measured["probes"].values()) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        probe_mod.estimate(stream, fp, 1e9, bits=(3, 4), exact_all_bits=True, on_save=stop_after_five)
    counted = []
    real = probe_mod.probe_kld
    try:
        probe_mod.probe_kld = lambda *a: counted.append(1) or real(*a)
        again = probe_mod.estimate(stream, fp, 1e9, bits=(3, 4), exact_all_bits=True, saved=saved)
    finally:
        probe_mod.probe_kld = real
    pairs = sum(len(v) for v in full.kld.values() if v) and sum(
        1 for p in full.kld for f in full.kld[p] if f not in full.estimated[p])
    assert len(counted) == pairs - 5
    for p in full.kld:
        for f, v in full.kld[p].items():
            assert again.kld[p][f] == pytest.approx(v, rel=1e-4, abs=1e-9)


def test_probe_estimate_interpolates_unprobed_tensors(tiny_dense):
    from mixbit.quant import calibration as calib
    from mixbit.quant.probe import estimate, first_pass
    from mixbit.quant.stream import LayerStream
    from mlx_lm.utils import load_tokenizer

    cal = calib.build(load_tokenizer(tiny_dense), n_rows=4, length=32)
    stream = LayerStream(tiny_dense)
    fp = first_pass(stream, cal.rows)
    few = estimate(stream, fp, budget_s=0.0)  # one probe: the budget is spent at once
    assert few.meta["method"] == "probe" and few.meta["probes"] == 1
    assert all(v > 0 for per in few.kld.values() for v in per.values())
    for per in few.kld.values():  # fewer bits never look better than more, within a group size
        for g in (32, 64, 128):
            vals = [per[f"q{b}g{g}"] for b in (2, 3, 4, 5, 6, 8) if f"q{b}g{g}" in per]
            assert vals == sorted(vals, reverse=True)


def test_moe_fixture_quantizes_loads_in_stock_mlx_lm_and_serves(tmp_path, tiny_moe):
    from mlx_lm import generate, load

    v = ensure_variant(resolve(str(tiny_moe)), "mixbit-auto", cache_dir=str(tmp_path),
                       sensitivity="probe", sensitivity_seconds=5)
    recipe = json.loads((v.path / "recipe.json").read_text())
    tensors = recipe["tensors"]
    experts = [p for p in tensors if "switch_mlp" in p]
    assert experts and all(tensors[p]["bits"] < 16 for p in experts)  # stacked experts quantized
    gates = [p for p in tensors if p.endswith(("mlp.gate", "shared_expert_gate"))]
    assert gates and all(tensors[p]["bits"] >= 8 for p in gates)
    assert recipe["bits_per_weight"] <= 4.5 + 1e-9
    index = json.loads((v.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("mtp.") for k in index)  # the MTP head is kept
    assert not any("visual" in k for k in index)  # the vision tower is not
    assert recipe["mtp"]["kept"]
    heads = recipe["mtp"]["tensors"]  # the head's linears at the format measured for it, gates as stored
    assert {f for n, f in heads.items() if n.endswith("proj.weight") or n == "mtp.fc.weight"} == {"q6g64"}
    assert all(f == "as stored" for n, f in heads.items() if "norm" in n or n.endswith("mlp.gate.weight"))
    model, tok = load(str(v.path))  # stock mlx-lm (its sanitize drops mtp.* on load)
    assert isinstance(generate(model, tok, "Hello", max_tokens=4), str)
    s = ServerProcess(f"model.source='{tiny_moe}'", f"model.cache_dir='{tmp_path}'",
                      "quant.sensitivity='probe'", "quant.sensitivity_seconds=5",
                      recipe="mixbit-auto").wait_ready(timeout=300)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "ckpt", "messages": ask("Hi"), "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        s.stop()
    assert "cached variant mixbit-auto verified" in s.log_path.read_text()


def test_progress_reports_stage_step_and_eta():
    seen = []
    p = Progress(on_update=seen.append, log_every_s=0)
    p.stage("sensitivity", 4, "probes")
    p.step(1)
    time.sleep(0.05)
    p.step(2)
    snap = p.snapshot()
    assert (snap.stage, snap.step, snap.total) == ("sensitivity", 2, 4)
    assert snap.eta_s is not None and snap.eta_s > 0
    assert "sensitivity: 2/4" in snap.line()
    p.stage("awq+write", 2)
    assert p.stage_seconds["sensitivity"] >= 0.05
    assert seen and seen[-1].stage == "awq+write"


def test_first_start_progress_on_ready_and_metrics(tmp_path):
    s = ServerProcess(f"model.cache_dir='{tmp_path}'", "quant.sensitivity='probe'",
                      "quant.sensitivity_seconds=8", recipe="mixbit-auto")
    progress, gauges = [], []
    try:
        for r in s.poll("/ready", timeout=300, every=0.2):
            body = r.json()
            if r.status_code != 200 and "progress" in body:
                progress.append(body["progress"])
                m = httpx.get(s.url + "/metrics", timeout=5).text
                gauges += [line for line in m.splitlines() if line.startswith("mixbit_startup_")]
        assert r.status_code == 200
    finally:
        s.stop()
    stages = {p["stage"] for p in progress}
    assert "sensitivity" in stages, stages
    with_eta = [p for p in progress if p["total"] and p["step"] and p["eta_s"] is not None]
    assert with_eta and all(set(p) >= {"stage", "step", "total", "eta_s", "elapsed_s"} for p in with_eta)
    assert any(g.startswith("mixbit_startup_progress_ratio{stage=") for g in gauges)
    assert any(g.startswith("mixbit_startup_eta_seconds{stage=") for g in gauges)
    # the memory plan is on /ready from the first stage that does work, within its budget
    plans = [p["memory"] for p in progress if p["stage"] in ("activations", "sensitivity") and "memory" in p]
    assert plans and 0 < plans[0]["planned_gb"] <= plans[0]["budget_gb"], progress[:3]
    assert {"layer", "runtime"} <= set(plans[0]["parts_gb"])


def test_memory_of_a_first_start_does_not_grow_with_depth(tmp_path_factory, monkeypatch):
    """Quantizing reads one layer at a time: MLX's own peak allocation over a whole mixbit-auto
    first start (activations, probes, errors, AWQ + write, check) is the same at 4 and 8 layers
    (the old pipeline kept every layer it had read: 4 more layers, their bytes more)."""
    from mixbit.quant import probe
    from mixbit.quant.variants import quantize

    # the errors stage estimates from every third row of these 3M-weight tensors, as it does
    # every tensor past 4M weights at real sizes: its time shrinks (24 -> 13 s at 4 layers),
    # not what this test measures
    monkeypatch.setattr(probe, "ERROR_ELEMENTS", 1 << 18)

    peaks, sizes = {}, {}
    for n in (4, 8):
        folder = write_checkpoint(f"tiny-wide-{n}l", tmp_path_factory.mktemp(f"wide{n}") / "ckpt")
        sizes[n] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        dst = tmp_path_factory.mktemp(f"out{n}") / "variants" / "v"
        mx.clear_cache()
        mx.reset_peak_memory()
        manifest = quantize(resolve(str(folder)), "mixbit-auto", dst, target_bpw=4.5,
                            sensitivity="probe", sensitivity_seconds=3)
        peaks[n] = mx.get_peak_memory()
        assert artifact.verify(dst) is None and manifest["measured_kld"] >= 0
        assert not (dst / "layer-inputs").exists()
    # 4 more layers are 84 MB more checkpoint; holding what it read (the old pipeline) costs
    # all of it, and the rest of the peak (2,048 calibration tokens' activations) is ~380 MB
    assert sizes[8] - sizes[4] > 80e6
    assert peaks[8] <= peaks[4] + 0.1 * (sizes[8] - sizes[4]), (peaks, sizes)


def test_a_memory_budget_too_small_is_refused_before_any_work(tmp_path, tiny_dense):
    cache = tmp_path / "cache"
    with pytest.raises(MemoryError, match="quant.memory_gb"):
        ensure_variant(resolve(str(tiny_dense)), "uniform-4", cache_dir=str(cache), memory_gb=0.01)
    variants = cache / "variants"
    assert not variants.exists() or [p for p in variants.iterdir() if not p.name.startswith(".")] == []
    said = []
    v = ensure_variant(resolve(str(tiny_dense)), "uniform-4", cache_dir=str(cache), memory_gb=8,
                       progress=said.append)
    assert artifact.verify(v.path) is None
    assert any("memory: about" in s and "of a 8.0 GB budget" in s for s in said), said


def test_experts_in_chunks_compute_what_switchglu_does(tiny_moe):
    from mixbit.quant.stream import LayerStream

    stream = LayerStream(tiny_moe)
    x = mx.random.normal((2, 16, stream.lm.args.hidden_size), key=mx.random.key(0))
    with stream.layer(0, float32=True) as layer:
        moe = layer.mlp
        assert moe.expert_chunk == moe.num_experts  # the whole (tiny) stack fits one chunk
        assert moe.switch_mlp.gate_proj.weight.dtype == mx.bfloat16  # experts keep their dtype
        outs = {}
        for chunk in (0, 1, 3):
            moe.expert_chunk = chunk
            outs[chunk] = moe(x)
        # quantized experts: chunks dequantized from the packed form = the written stack, whole
        from mixbit.quant.formats import Format
        from mixbit.quant.writer import _packed_experts, _tensor_out

        fmt, stored = Format(4, 64), moe.switch_mlp.up_proj
        out = _tensor_out("up", stored.weight, fmt)
        packed = _packed_experts(stored, {k: out[f"up.{k}"] for k in ("weight", "scales", "biases")}, fmt)
        moe.expert_chunk = 1
        fake = mx.dequantize(out["up.weight"], out["up.scales"], out["up.biases"], group_size=64, bits=4)
        original = stored.weight
        stored.weight = fake
        want = moe(x)
        stored.weight = original
        moe.switch_mlp.up_proj = packed
        got = moe(x)
        moe.switch_mlp.up_proj = stored
        moe.expert_chunk = moe.num_experts
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-4).item() and not mx.allclose(got, outs[0]).item()
    assert mx.allclose(outs[1], outs[0], atol=1e-5, rtol=1e-4).item()
    assert mx.allclose(outs[3], outs[0], atol=1e-5, rtol=1e-4).item()


def test_float32_is_made_a_matrix_at_a_time_with_the_same_numbers(tiny_dense):
    """A layer read in float32 keeps its matrices as stored, each made float32 at its call and
    dropped after it (a 27B-wide layer would otherwise hold 1.5 GB of float32 copies), and
    computes what the layer holding float32 copies computes, bit for bit; so does the check's
    packed stand-in against the dequantized weight it replaces."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from mixbit.quant.formats import Format, dequantize, quantizable
    from mixbit.quant.stream import Float32Linear, LayerStream, _set_child
    from mixbit.quant.writer import _Dequantizing, _tensor_out

    stream = LayerStream(tiny_dense)
    h = stream.embed(mx.array([[1, 5, 9, 13, 17, 21, 25, 29]] * 2))
    cast = lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a  # noqa: E731
    for i in range(len(stream.layers)):
        assert any(v.ndim == 2 and v.dtype == mx.bfloat16 for v in stream.layer_weights(i).values())
        with stream.layer(i, float32=True) as layer:
            assert not [k for k, v in tree_flatten(layer.parameters()) if v.ndim == 2 and v.dtype == mx.float32]
            assert all(isinstance(m, Float32Linear) for m in quantizable(layer).values())
            got = stream.apply(i, layer, h)
        with stream.layer(i) as layer:  # every weight a float32 copy: the layer as it was run
            assert all(type(m) is nn.Linear for m in quantizable(layer).values())  # put back
            layer.update(tree_map(cast, layer.parameters()))
            want = stream.apply(i, layer, h)
            rel, module = next((r, m) for r, m in quantizable(layer).items() if m.weight.ndim == 2)
            out = _tensor_out("t", module.weight, Format(4, 64))
            packed = {k: out[f"t.{k}"] for k in ("weight", "scales", "biases")}
            module.weight = dequantize(*packed.values(), Format(4, 64))
            dequantized = stream.apply(i, layer, h)
            _set_child(layer, rel, _Dequantizing(packed, Format(4, 64)))
            from_packed = stream.apply(i, layer, h)
            _set_child(layer, rel, module)
        assert mx.array_equal(got, want).item(), i
        assert mx.array_equal(from_packed, dequantized).item() and not mx.array_equal(dequantized, want).item()


def test_streamed_kl_matches_the_direct_one_even_when_tiny(tiny_dense):
    """The head is read in chunks, but the KL of two nearly equal distributions (what a probe
    of a robust tensor measures) stays what the full log-softmax gives, not float32 noise."""
    from mixbit.quant.stream import LayerStream, kld_rows

    stream = LayerStream(tiny_dense)
    normed = mx.random.normal((300, stream.lm.args.hidden_size), key=mx.random.key(1)) * 3
    moved = normed + 1e-3 * mx.random.normal(normed.shape, key=mx.random.key(2))
    ref = stream.logprobs(normed)
    full = stream.lm.lm_head(moved) if not stream.tied else moved @ stream.head_weight()[:].astype(mx.float32).T
    direct = kld_rows(ref, full - mx.logsumexp(full, axis=-1, keepdims=True))
    kld, same = stream.compare(ref, moved)
    assert 0 < float(direct.mean()) < 1e-3
    assert mx.allclose(kld, direct, rtol=1e-3, atol=1e-8).item()
    assert same.all().item()


@pytest.mark.parametrize("which", ["embedded", "moe"])
def test_awq_inputs_and_the_next_layer_from_one_pass(which, embedded_path, tiny_moe):
    # the writer takes AWQ's group inputs and the next layer's hidden states from one pass of a
    # layer: the same values as the layer run whole (linear-attention, full-attention, MoE layers)
    from mixbit.quant.awq import group_inputs
    from mixbit.quant.stream import LayerStream

    stream = LayerStream(embedded_path if which == "embedded" else tiny_moe)
    h = stream.embed(mx.random.randint(0, 1000, (3, 40), key=mx.random.key(2)))
    kinds = set()
    for i in range(len(stream.layers)):
        with stream.layer(i, float32=True) as layer:
            alone = group_inputs(layer, h)
            inputs, nxt = group_inputs(layer, h, output=True)
            whole = stream.apply(i, layer, h)
        kinds.add(layer.is_linear)
        assert all(mx.array_equal(alone[k], inputs[k]).item() for k in alone)
        assert mx.array_equal(nxt, whole).item(), i
        h = whole
    assert kinds == {True, False}


def test_weighted_errors_on_two_streams_are_the_sums_on_one():
    from mixbit.quant.formats import formats_for
    from mixbit.quant.probe import weighted_errors

    w = (mx.random.normal((3000, 256), key=mx.random.key(3)) * 0.02).astype(mx.bfloat16)
    imp = mx.random.uniform(shape=(256,), key=mx.random.key(4))
    rows = mx.random.uniform(shape=(3000,), key=mx.random.key(5))
    for weights, by_row in ((imp, False), (rows, True)):
        one = weighted_errors(w, formats_for(256), weights, by_row=by_row, streams=1)
        two = weighted_errors(w, formats_for(256), weights, by_row=by_row, streams=2)
        assert one == two and len(one) == 18 and all(v > 0 for v in one.values())


def test_an_expert_stack_weighs_each_experts_error_by_its_own_importance():
    """A stack of routed experts [E, out, in] with one importance row per expert: each expert's
    error counts under its own row, so an expert no calibration token reached adds nothing."""
    from mixbit.quant.formats import Format, fake_quantize
    from mixbit.quant.probe import weighted_errors

    w = (mx.random.normal((4, 32, 128), key=mx.random.key(3)) * 0.02).astype(mx.bfloat16)
    imp = mx.random.uniform(shape=(4, 128), key=mx.random.key(4)) * (mx.arange(4) != 2)[:, None]
    fmts = [Format(3, 64), Format(4, 64)]
    got = weighted_errors(w, fmts, imp)
    for fmt in fmts:
        flat = w.reshape(-1, 128)
        d = flat.astype(mx.float32) - fake_quantize(flat, fmt).astype(mx.float32)
        want = float(((d * d).reshape(4, 32, 128).sum(axis=1) * imp).sum().item())
        assert got[fmt.name] == pytest.approx(want, rel=1e-5)
    noisy = mx.random.normal((4, 32, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    unrouted = mx.where((mx.arange(4) == 2)[:, None, None], noisy, w)
    assert weighted_errors(unrouted, fmts, imp) == got
    routed = mx.where((mx.arange(4) == 1)[:, None, None], noisy, w)
    assert all(v > got[k] for k, v in weighted_errors(routed, fmts, imp).items())


def test_expert_importance_is_each_experts_routed_inputs_per_token(tiny_moe):
    """The first pass records, for a stack of routed experts, one importance row per expert: the
    squares of the inputs routed to it, each times its routing weight squared, over the tokens."""
    import mlx.nn as nn

    from mixbit.quant.probe import first_pass
    from mixbit.quant.stream import LayerStream

    stream = LayerStream(tiny_moe)
    rows = mx.random.randint(0, 1000, (3, 40), key=mx.random.key(7))
    fp = first_pass(stream, rows)
    seen = {}

    class Spy(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, *args, **kwargs):
            seen["x"] = x
            return self.inner(x, *args, **kwargs)

    with stream.layer(0, float32=True) as layer:
        moe = layer.mlp
        layer.mlp = Spy(moe)
        try:
            stream.apply(0, layer, stream.embed(rows))
        finally:
            layer.mlp = moe
        x = seen["x"].reshape(-1, seen["x"].shape[-1]).astype(mx.float32)
        gates = mx.softmax(moe.gate(x).astype(mx.float32), axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-moe.top_k, axis=-1)[..., -moe.top_k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if moe.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        want = mx.zeros((moe.num_experts, x.shape[1]))
        for slot in range(moe.top_k):
            want = want.at[inds[:, slot]].add(x * x * scores[:, slot:slot + 1] ** 2)
        want = want / x.shape[0]
    for proj in ("gate_proj", "up_proj"):
        got = fp.imp[f"{stream.layer_path(0)}.mlp.switch_mlp.{proj}"]
        assert got.shape == (moe.num_experts, x.shape[1])
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-7).item()
    down = fp.imp[f"{stream.layer_path(0)}.mlp.switch_mlp.down_proj"]
    assert down.shape[0] == moe.num_experts and mx.all(down >= 0).item()
