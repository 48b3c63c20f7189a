"""One CPU plan per machine and variant, the same every start (models/forward/plan.py): measured
at the first start under generation.cpu_quantized "auto", kept beside the variants, read back at
the next start, shown in /v1/models; "packed" plans by rule, without timing."""

from __future__ import annotations

import json

import httpx
import pytest

from mixbit.models import kernels

from .server_proc import ServerProcess

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"no kernels: {kernels.IMPORT_ERROR}")
MODEL = "tiny-qwen3.5"


@needs_kernels
def test_a_measured_plan_is_kept_and_read_back(embedded_path, tmp_path):
    from mlx_lm.utils import load_model

    from mixbit.models.forward.plan import CpuPlan, cached_plan, plan_path
    from mixbit.models.forward.qwen3_5 import model_classes

    model, _ = load_model(embedded_path, get_model_classes=model_classes)  # bf16, as stored
    first = cached_plan(model, embedded_path, tmp_path, "auto", "auto", dense_budget=1 << 30)
    assert first.source == "measured" and first.shapes
    path = plan_path(tmp_path, embedded_path, "auto", "auto", first.small)
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    again = cached_plan(model, embedded_path, tmp_path, "auto", "auto", dense_budget=1 << 30)
    assert again.source == "cached" and again.shapes == first.shapes
    assert CpuPlan.from_json(json.loads(path.read_text())).shapes == first.shapes
    # other settings are another plan; an unreadable file is measured again and replaced
    assert plan_path(tmp_path, embedded_path, "auto", "float32", first.small) != path
    path.write_text("{not json")
    redone = cached_plan(model, embedded_path, tmp_path, "auto", "auto", dense_budget=1 << 30)
    assert redone.source == "measured" and json.loads(path.read_text())["version"] >= 1
    # no place to keep it: measured, nothing written
    assert cached_plan(model, embedded_path, None, "auto", "auto", dense_budget=1 << 30).source == "measured"


@needs_kernels
def test_a_rule_plan_needs_no_timing(embedded_path):
    from mlx_lm.utils import load_model

    from mixbit.models.forward.plan import rule_plan
    from mixbit.models.forward.qwen3_5 import model_classes

    model, _ = load_model(embedded_path, get_model_classes=model_classes)
    one, two = rule_plan(model, "float32", small=0), rule_plan(model, "float32", small=0)
    assert one.shapes == two.shapes and all(s.runs == "packed" and s.decode == "float32"
                                            for s in one.shapes.values())


def _logprobs(url: str) -> list:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    return [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
            for t in r.json()["choices"][0]["logprobs"]["content"]]


@needs_kernels
def test_two_starts_of_a_variant_compute_the_same_logprobs(tmp_path):
    """`mixbit serve` under cpu_quantized "auto": the first start measures the plan and keeps
    it under model.cache_dir, the second reads it (/v1/models says which); the same request
    gets identical log-probabilities from both."""
    starts = []
    for _ in range(2):
        s = ServerProcess("server.request_timeout_s=120", recipe="uniform-4", cache_dir=str(tmp_path)).wait_ready(600)
        try:
            plan = httpx.get(s.url + "/v1/models").json()["data"][0]["mixbit"]["cpu_plan"]
            starts.append((plan, _logprobs(s.url)))
        finally:
            s.stop()
    (first_plan, first), (second_plan, second) = starts
    assert first_plan["source"] == "measured" and second_plan["source"] == "cached"
    assert first_plan["shapes"] == second_plan["shapes"]
    # the card names the kernels' instruction-set path the plan was measured on
    assert first_plan["machine"]["isa"] == second_plan["machine"]["isa"] == kernels.info()["isa"]
    assert list((tmp_path / "cpu-plans").glob("*.json"))
    assert first == second
