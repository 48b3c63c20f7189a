"""Prometheus metrics and fidelity spot checks, end to end: a quantized variant served by the real
process, scraped by a real Prometheus (Debian's package, installed by `make test`), queried
through Prometheus's HTTP API; the alert rules load; /v1/fidelity shows the checks; a second
mixbit instance serving bf16 works as a remote reference; drops are counted, never waited for."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import ROOT, WEATHER
from .server_proc import ServerProcess, free_port, metric_value

MODEL = "tiny-qwen3.5"


def _traffic(url: str, n: int = 4) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    for i in range(n):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                                  tools=WEATHER, temperature=0, seed=i)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please: name Leo, age 40."}],
                                  response_format={"type": "json_object"}, temperature=0)


def _wait(predicate, timeout=60.0, every=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not met")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    s = ServerProcess("fidelity.sample_rate=1.0", "fidelity.max_per_minute=1000",
                      "server.api_keys=['k']", recipe="uniform-4", cache_dir=str(cache)).wait_ready(300)
    _traffic(s.url)
    yield s
    s.stop()


def _metrics(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def test_serving_tool_and_variant_metrics(served):
    def enough():
        t = _metrics(served.url)
        return t if metric_value(t, "mixbit_fidelity_checks_total") >= 8 else None

    text = _wait(enough)
    assert metric_value(text, "mixbit_requests_total", endpoint="/v1/chat/completions", status="200") >= 8
    assert metric_value(text, "mixbit_time_to_first_token_seconds_count", endpoint="/v1/chat/completions") >= 8
    assert metric_value(text, "mixbit_inter_token_latency_seconds_count") > 0
    assert metric_value(text, "mixbit_generation_tokens_total") > 0
    assert metric_value(text, "mixbit_tool_call_outcomes_total", outcome="parsed") >= 4
    assert metric_value(text, "mixbit_tool_call_outcomes_total", outcome="markup_in_content") == 0
    assert metric_value(text, "mixbit_constrained_output_invalid_total") == 0
    assert metric_value(text, "mixbit_grammar_requests_total") >= 8
    assert metric_value(text, "mixbit_variant_info", recipe="uniform-4", bits_per_weight="4.5") == 1
    assert 'measured_kld="' in text
    assert metric_value(text, "mixbit_memory_bytes") > 10_000_000
    # fidelity: every request checked; a 4-bit model is close to bf16 but not equal
    assert metric_value(text, "mixbit_fidelity_checks_total", kind="tool_call", variant="uniform-4") >= 4
    assert metric_value(text, "mixbit_fidelity_checks_total", kind="json", variant="uniform-4") >= 4
    assert 0 < metric_value(text, "mixbit_fidelity_kld_sum") < metric_value(text, "mixbit_fidelity_kld_count")


def test_models_endpoint_and_fidelity_view_carry_provenance(served):
    auth = {"Authorization": "Bearer k"}
    card = httpx.get(served.url + "/v1/models", headers=auth).json()["data"][0]
    assert card["mixbit"]["recipe"] == "uniform-4" and card["mixbit"]["measured_kld"] > 0
    assert httpx.get(served.url + "/v1/fidelity").status_code == 401  # behind the key
    view = httpx.get(served.url + "/v1/fidelity?limit=5", headers=auth).json()
    assert view["enabled"] and view["variants"] == ["uniform-4"] and len(view["checks"]) == 5
    check = view["checks"][0]
    assert set(check) >= {"kind", "tokens", "kld_mean", "top1_agreement", "flips", "first_divergence"}
    assert check["kld_mean"] >= 0 and 0 <= check["top1_agreement"] <= 1


@contextlib.contextmanager
def prometheus(tmp_path: Path, target_port: int):
    """A real Prometheus scraping 127.0.0.1:`target_port` every second with the shipped alert rules;
    yields (query, api): query(promql) is the result list, or None while it is empty."""
    port = free_port()
    rules = tmp_path / "alerts.yml"
    rules.write_text((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{rules}"]
scrape_configs:
  - job_name: mixbit
    static_configs: [{{targets: ["127.0.0.1:{target_port}"]}}]
""")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(q):
        try:
            r = httpx.get(api + "/query", params={"query": q}, timeout=5).json()
        except (httpx.HTTPError, ValueError):  # not up yet, or a plain-text answer while starting
            return None
        return r["data"]["result"] if r.get("status") == "success" and r["data"]["result"] else None

    try:
        yield query, api
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


NO_PROMETHEUS = pytest.mark.skipif(shutil.which("prometheus") is None,
                                   reason="no prometheus binary: `make test` installs it")


@NO_PROMETHEUS
def test_real_prometheus_scrapes_and_queries_fidelity(served, tmp_path):
    with prometheus(tmp_path, served.port) as (query, api):
        up = _wait(lambda: query('up{job="mixbit"} == 1'), timeout=60)
        assert up
        _traffic(served.url, n=2)  # more checks while Prometheus watches

        def kinds():  # the checks finish after the answers: wait for the scrape that has them
            result = query('sum by (kind) (mixbit_fidelity_checks_total{variant="uniform-4"})') or []
            found = {r["metric"]["kind"]: float(r["value"][1]) for r in result}
            return found if found.get("tool_call", 0) >= 4 and found.get("json", 0) >= 4 else None

        assert _wait(kinds, timeout=120)
        flips = _wait(lambda: query("sum(mixbit_fidelity_tokens_total) > 0"))
        assert float(flips[0]["value"][1]) > 0
        p95 = _wait(lambda: query('histogram_quantile(0.95, sum by (le) (mixbit_fidelity_kld_bucket))'))
        assert 0 < float(p95[0]["value"][1]) < 1
        info = _wait(lambda: query('mixbit_variant_info{recipe="uniform-4"}'))
        assert info[0]["metric"]["source"] == "embedded:tiny-qwen3.5"
        groups = httpx.get(api + "/rules", timeout=5).json()["data"]["groups"]
        names = {r["name"] for g in groups for r in g["rules"]}
        assert {"MixbitFidelityKLDHigh", "MixbitToolCallMarkupLeak", "MixbitQueueSaturated"} <= names
        assert all(r["health"] != "err" for g in groups for r in g["rules"])
        # every query of the shipped Grafana dashboard parses and runs (Grafana's variables filled in)
        dashboard = json.loads((ROOT / "deploy" / "grafana" / "mixbit-dashboard.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                q = target["expr"].replace("$__rate_interval", "1m").replace("$variant", ".*")
                r = httpx.get(api + "/query", params={"query": q}, timeout=5).json()
                assert r.get("status") == "success", (panel["title"], q, r)


def test_remote_bf16_reference_and_rate_cap(tmp_path):
    reference = ServerProcess().wait_ready()  # a bf16 mixbit instance
    try:
        served = ServerProcess(f"fidelity.reference='{reference.url}'", "fidelity.sample_rate=1.0",
                               "fidelity.max_per_minute=3", recipe="uniform-4",
                               cache_dir=str(tmp_path)).wait_ready(300)
        try:
            _traffic(served.url, n=3)  # 6 requests, 3 allowed a minute
            def three():
                v = httpx.get(served.url + "/v1/fidelity").json()
                return v if len(v["checks"]) == 3 else None

            view = _wait(three)
            assert view["reference"] == reference.url
            assert all(c["kld_mean"] > 0 for c in view["checks"])
            text = _metrics(served.url)
            assert metric_value(text, "mixbit_fidelity_dropped_total", reason="rate_cap") == 3
            score = httpx.post(reference.url + "/v1/score", json={"tokens": [1, 2, 3], "start": 0}).status_code
            assert score == 400  # bad input gets a clear error from the reference too
        finally:
            served.stop()
    finally:
        reference.stop()
