"""One request can never take the engine down; a dead engine thread is restarted and /ready says
so meanwhile; kubelet's service-link variables never stop start-up; /v1/models keeps local paths
from unauthenticated clients; the CLI runs MLX on an optimized BLAS without any preload."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from mixbit.server.engine import Engine, FinishEvent
from mixbit.server.sampling import SamplingParams

from .conftest import ROOT
from .server_proc import ServerProcess
from .test_server_api import MODEL, ask
from .test_settings import KUBELET_MIXBIT


# ------------------------------------------------------------------------- the engine, in process
@pytest.fixture
def engine(loaded_tiny):
    e = Engine(loaded_tiny.model, loaded_tiny.tokenizer, max_batch=4)
    e.start(watch_every=0.05)
    yield e
    e.close()


def _prompt(lm, text="Count from 1 to 20."):
    from mixbit.models.chat.template import render_chat

    return lm.tokenizer.encode(render_chat(lm.tokenizer, ask(text), None), add_special_tokens=False)


def _run(engine, prompt, params, processors=None, timeout=60.0) -> FinishEvent:
    done: list = []
    engine.submit(prompt, params, lambda ev: done.append(ev) if isinstance(ev, FinishEvent) else None,
                  extra_processors=processors)
    deadline = time.time() + timeout
    while not done:
        assert time.time() < deadline, "the engine did not finish the request"
        time.sleep(0.01)
    return done[0]


def _submit_all(engine, jobs) -> list[FinishEvent]:
    """Submits (prompt, params, processors) together so they share batches; waits for all."""
    done: dict[int, FinishEvent] = {}
    for i, (prompt, params, processors) in enumerate(jobs):
        engine.submit(prompt, params, lambda ev, i=i: done.__setitem__(i, ev)
                      if isinstance(ev, FinishEvent) else None, extra_processors=processors)
    deadline = time.time() + 60
    while len(done) < len(jobs):
        assert time.time() < deadline
        time.sleep(0.01)
    return [done[i] for i in range(len(jobs))]


def test_a_failing_processor_ends_only_its_own_request(engine, loaded_tiny):
    prompt = _prompt(loaded_tiny)
    calls = []

    def broken(tokens, logits):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("grammar state corrupted")
        return logits

    params = SamplingParams(max_tokens=12, temperature=0)
    bad, good = _submit_all(engine, [(prompt, params, [broken]), (prompt, params, None)])
    assert bad.reason == "error" and bad.status == 500 and "grammar state corrupted" in bad.error
    assert good.reason == "length" and good.completion_tokens == 12
    assert engine.alive and engine.restarts == 0
    assert _run(engine, prompt, params).reason == "length"  # and it keeps serving


def test_a_request_that_cannot_be_admitted_ends_alone(engine, loaded_tiny):
    """2**80 as a seed once killed the engine thread from admission (mx.random.key raised); the
    HTTP layer now answers it with a 400, so here a value no validation lets through stands in
    for whatever else admission may one day meet."""
    prompt = _prompt(loaded_tiny)
    bad = _run(engine, prompt, SamplingParams(max_tokens=4, temperature=1.0, stop=5))
    assert bad.reason == "error" and bad.status == 500 and "TypeError" in bad.error
    ok = _run(engine, prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 - 1))
    assert ok.reason == "length" and engine.alive and engine.restarts == 0


def test_a_dead_engine_thread_is_restarted(engine, loaded_tiny):
    prompt = _prompt(loaded_tiny)
    real_step = engine._step

    def dies(gen):
        engine._step = real_step
        raise KeyboardInterrupt  # a BaseException: past the loop's own restart, the thread ends

    engine._step = dies
    first = _run(engine, prompt, SamplingParams(max_tokens=8, temperature=0))
    assert first.reason == "error" and first.status == 503  # interrupted: retry
    deadline = time.time() + 10
    while not engine.alive:
        assert time.time() < deadline, "the watchdog did not restart the engine thread"
        time.sleep(0.02)
    assert engine.restarts == 1
    again = _run(engine, prompt, SamplingParams(max_tokens=8, temperature=0))
    assert again.reason == "length" and again.completion_tokens == 8


def test_a_failing_loop_restarts_in_place(engine, loaded_tiny):
    prompt = _prompt(loaded_tiny)
    real = engine._apply

    def broken(gen, op):
        engine._apply = real
        raise MemoryError("allocator failure outside any one request")

    engine._apply = broken  # the loop itself fails (not one sequence): it starts again
    first = _run(engine, prompt, SamplingParams(max_tokens=8, temperature=0))
    assert first.reason == "error" and first.status == 503  # taken from the queue, not lost
    assert engine.alive and engine.restarts == 1
    assert _run(engine, prompt, SamplingParams(max_tokens=8, temperature=0)).reason == "length"


# ---------------------------------------------------------------------------- the app, in process
def test_ready_is_503_while_the_engine_cannot_serve(monkeypatch):
    from fastapi.testclient import TestClient

    from mixbit.server.app import create_app
    from mixbit.server.settings import load_settings

    settings = load_settings(None, cli={"quant": {"recipe": "bf16"}, "fidelity": {"enabled": False}},
                             environ={})
    app = create_app(settings)
    with TestClient(app) as client:
        deadline = time.time() + 120
        while client.get("/ready").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        engine = app.state.mixbit.variants[0].engine
        monkeypatch.setattr(engine, "revive", lambda: None)  # hold it dead while we look

        def dies(gen):
            raise SystemExit(3)

        monkeypatch.setattr(engine, "_step", dies)
        body = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarted"
        assert r.headers["Retry-After"]
        assert not engine.alive
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 503
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        monkeypatch.undo()  # the real revive and step: the watchdog brings it back
        deadline = time.time() + 10
        while client.get("/ready").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert engine.restarts == 1


# ------------------------------------------------------------------------------ the real server
def test_server_starts_with_kubelet_service_link_variables():
    s = ServerProcess(env=KUBELET_MIXBIT).wait_ready()
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": ask("Hi"), "max_tokens": 4})
        assert r.status_code == 200
    finally:
        s.stop()
    log = s.log_path.read_text()
    lines = [line for line in log.splitlines() if "not settings" in line]
    assert len(lines) == 1 and all(name in lines[0] for name in KUBELET_MIXBIT)


def test_models_hide_local_paths_unless_authenticated(tmp_path):
    key = "sk-hardening"
    open_server = ServerProcess().wait_ready()
    keyed = ServerProcess(f"server.api_keys=['{key}']").wait_ready()
    try:
        card = httpx.get(open_server.url + "/v1/models").json()["data"][0]["mixbit"]
        text = json.dumps(card)
        assert str(ROOT) not in text and card["path"] == "<local path>"
        assert card["recipe"] == "bf16" and card["source"] == "embedded:tiny-qwen3.5"
        card = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        assert card["data"][0]["mixbit"]["path"].startswith(str(ROOT))
        one = httpx.get(open_server.url + f"/v1/models/{MODEL}").json()["mixbit"]
        assert one["path"] == "<local path>"
    finally:
        open_server.stop()
        keyed.stop()


# ---------------------------------------------------------------------------------------- BLAS
BLAS_PROBE = """
import ctypes, json, sys
from mixbit.models.blas import ensure_fast_blas
choice = ensure_fast_blas()
import mlx.core as mx
def addr(lib):
    return ctypes.cast(getattr(lib, "cblas_sgemm"), ctypes.c_void_p).value
bound = addr(ctypes.CDLL(None))  # what a library that needs cblas_sgemm (libmlx) binds to
ours = addr(ctypes.CDLL(choice.path)) if choice.path else None
a = mx.ones((64, 64)); assert float((a @ a)[0, 0]) == 64.0
print(json.dumps({"name": choice.name, "path": choice.path, "bound_to_ours": bound == ours}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheels only")
def test_mixbit_binds_mlx_to_an_optimized_blas_without_preload():
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}  # no LD_PRELOAD, as `.venv/bin/mixbit`
    out = subprocess.run([sys.executable, "-c", BLAS_PROBE], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["name"] in ("cmeel-openblas", "system"), info
    assert "openblas" in info["path"] and info["bound_to_ours"], info


def test_an_openblas_built_for_one_core_is_only_used_where_it_runs():
    """The cmeel-openblas 0.3.31 wheel is built for SKYLAKEX only: on an AVX2-only CPU its first
    sgemm killed `mixbit serve` with SIGILL. Such a build is passed over for the next candidate."""
    from mixbit.models.blas import runs_here

    skx = "OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"
    avx2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512vbmi"}
    why = runs_here(skx, "SKYLAKEX", "x86_64", avx2)
    assert "SKYLAKEX" in why and "avx512f" in why
    assert runs_here(skx, "SKYLAKEX", "x86_64", avx512) == ""
    assert runs_here("OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64", "Zen", "x86_64", avx2) == ""
    assert runs_here("OpenBLAS 0.3.31 NEOVERSEN1", "NEOVERSEN1", "aarch64", set()) == ""
    assert "cannot check" in runs_here("OpenBLAS 0.4 NEWCORE", "NEWCORE", "x86_64", avx512)


def test_no_fast_blas_is_one_loud_warning(caplog):
    from mixbit.models import blas

    saved = blas._CHOICE
    blas._CHOICE = blas.BlasChoice("none", error="libgfortran.so.5: cannot open shared object file")
    try:
        with caplog.at_level("INFO", logger="mixbit.blas"):
            blas.report()
    finally:
        blas._CHOICE = saved
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "NO FAST BLAS" in record.message
    assert "libgfortran" in record.message and "apt-get install" in record.message


def test_seed_edges_over_http():
    s = ServerProcess().wait_ready()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:  # one keep-alive connection
            base = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4, "temperature": 1.0}
            r = c.post("/v1/chat/completions", json={**base, "seed": 2**80})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
            outs = []
            for seed in (2**64 - 1, -1, -(2**63), 2**64 - 1):
                r = c.post("/v1/chat/completions", json={**base, "seed": seed})
                assert r.status_code == 200, r.text
                outs.append(r.json()["choices"][0]["message"]["content"])
            assert outs[0] == outs[3]  # the same seed, the same tokens
            assert c.get("/ready").status_code == 200
    finally:
        s.stop()


def test_json_escaped_surrogate_pair_is_fine_and_lone_one_is_named():
    s = ServerProcess().wait_ready()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            def raw(content: str):
                return c.post("/v1/chat/completions", headers={"content-type": "application/json"},
                              content=('{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
                                       '"content": "%s"}]}' % (MODEL, content)).encode())
            assert raw("smile \\ud83d\\ude00").status_code == 200  # a pair: one emoji
            r = raw("bad \\ud800 here")
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "messages[0].content"
            assert r.json()["error"]["code"] == "invalid_unicode"
            assert raw("fine").status_code == 200  # the same connection still serves
    finally:
        s.stop()


def test_failing_samplers_in_a_row_leave_the_batch_healthy(engine, loaded_tiny):
    """top_k beyond the vocabulary raised inside mlx-lm's sampler; two in a row once left the
    batch generator unable to evaluate anything (every later request a 500)."""
    prompt = _prompt(loaded_tiny)
    bad = SamplingParams(max_tokens=6, temperature=1.0, top_k=10**6)
    good = SamplingParams(max_tokens=6, temperature=0)
    results = _submit_all(engine, [(prompt, bad, None), (prompt, bad, None), (prompt, good, None)])
    assert [r.reason for r in results] == ["error", "error", "length"]
    for _ in range(2):
        assert _run(engine, prompt, good).reason == "length"
    assert engine.alive and engine.restarts == 0
