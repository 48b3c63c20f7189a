"""Several quantized variants side by side in one `mixbit serve` process: each picked by `model`
(`<name>:<variant>`, the bare name is the first), listed with its provenance, answering through its
own engine, and checked against the one bf16 reference with its own fidelity series in a real
Prometheus scrape; /v1/fidelity filters by variant; every request is mirrored to the next variant
and the two outputs compared; a memory budget refuses what does not fit."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import WEATHER
from .server_proc import ServerProcess, metric_value
from .test_metrics import NO_PROMETHEUS, _metrics, _wait, prometheus

NAME = "tiny-qwen3.5"
VARIANTS = ["uniform-4", "uniform-3", "bf16"]
OSLO = [{"role": "user", "content": "What's the weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    s = ServerProcess(f"quant.variants={json.dumps(VARIANTS)}", "fidelity.sample_rate=1.0",
                      "fidelity.max_per_minute=1000", "fidelity.mirror_rate=1.0", recipe=None,
                      cache_dir=str(cache)).wait_ready(600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0)


def test_every_variant_is_listed_with_its_provenance(served):
    cards = httpx.get(served.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [f"{NAME}:{v}" for v in VARIANTS]
    for card, variant in zip(cards, VARIANTS):
        assert card["mixbit"]["recipe"] == variant and card["max_model_len"] == 4096
    bpw = {c["id"]: c["mixbit"]["bits_per_weight"] for c in cards}
    assert bpw[f"{NAME}:uniform-3"] < bpw[f"{NAME}:uniform-4"] < bpw[f"{NAME}:bf16"] == 16.0
    one = httpx.get(served.url + f"/v1/models/{NAME}:uniform-3").json()
    assert one["id"] == f"{NAME}:uniform-3" and one["mixbit"]["recipe"] == "uniform-3"


def test_each_variant_answers_through_its_own_engine(served, client):
    for variant in VARIANTS:
        r = client.chat.completions.create(model=f"{NAME}:{variant}", messages=OSLO, tools=WEATHER,
                                           temperature=0, max_tokens=48)
        assert r.model == f"{NAME}:{variant}"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    # the bare name is the first variant
    r = client.chat.completions.create(model=NAME, messages=OSLO, tools=WEATHER, temperature=0, max_tokens=48)
    assert r.model == f"{NAME}:uniform-4"
    engines = httpx.get(served.url + "/ready").json()["engines"]
    assert set(engines) == {f"{NAME}:{v}" for v in VARIANTS}


def test_a_variant_not_served_is_a_404_naming_the_served_ones(served, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model=f"{NAME}:uniform-2", messages=OSLO, max_tokens=4)
    body = err.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(f"{NAME}:{v}" in body["message"] for v in VARIANTS)


def _traffic(client, n: int = 3) -> None:
    for variant in VARIANTS:
        for i in range(n):
            client.chat.completions.create(model=f"{NAME}:{variant}", messages=OSLO, tools=WEATHER,
                                           temperature=0, seed=i, max_tokens=48)


def test_fidelity_is_checked_per_variant_against_one_reference(served, client):
    _traffic(client)

    def checked():
        t = _metrics(served.url)
        return t if all(metric_value(t, "mixbit_fidelity_checks_total", variant=v) >= 3 for v in VARIANTS) else None

    text = _wait(checked, timeout=180)
    for v in VARIANTS:
        assert metric_value(text, "mixbit_tool_call_outcomes_total", outcome="parsed", variant=v) >= 3
        assert metric_value(text, "mixbit_variant_info", variant=v, recipe=v) == 1
    # bf16 is its own reference; the quantized variants drift from it, uniform-3 the most
    kld = {v: metric_value(text, "mixbit_fidelity_kld_sum", variant=v) / metric_value(text, "mixbit_fidelity_kld_count", variant=v)
           for v in VARIANTS}
    assert kld["bf16"] < 1e-6 < kld["uniform-4"]
    view = httpx.get(served.url + "/v1/fidelity", params={"variant": "uniform-3"}).json()
    assert view["enabled"] and view["checks"] and {c["variant"] for c in view["checks"]} == {"uniform-3"}
    assert set(view["variants"]) == set(VARIANTS)
    assert httpx.get(served.url + "/v1/fidelity", params={"variant": "uniform-9"}).status_code == 404


def _mirrored(text: str, variant: str, mirror: str, outcome: str | None = None) -> float:
    return metric_value(text, "mixbit_mirror_comparisons_total", variant=variant, mirror=mirror,
                  **({"outcome": outcome} if outcome else {}))


def test_mirroring_compares_each_answer_with_the_next_variant(served, client):
    pairs = list(zip(VARIANTS, VARIANTS[1:] + VARIANTS[:1]))  # uniform-4 -> uniform-3 -> bf16 -> uniform-4
    before = _metrics(served.url)
    json_ask = [{"role": "user", "content": "JSON please: name Leo, age 40."}]
    for variant in VARIANTS:
        r = client.chat.completions.create(model=f"{NAME}:{variant}", messages=OSLO, tools=WEATHER,
                                           temperature=0, max_tokens=48)
        assert r.choices[0].message.tool_calls  # the client sees its own variant's answer only
        client.chat.completions.create(model=f"{NAME}:{variant}", messages=json_ask, temperature=0,
                                       max_tokens=48, response_format={"type": "json_object"})

    def compared():
        t = _metrics(served.url)
        done = all(_mirrored(t, a, b) - _mirrored(before, a, b) >= 2 for a, b in pairs)
        return t if done else None

    after = _wait(compared, timeout=120)
    for a, b in pairs:
        # every variant calls get_weather({"city": "Oslo"}) here (the test above): the same call
        assert _mirrored(after, a, b, "same_call") - _mirrored(before, a, b, "same_call") == 1
        # the mirror decodes under the same grammar: its JSON is valid, equal or not
        assert _mirrored(after, a, b, "mirror_json_invalid") == 0
        assert _mirrored(after, a, b, "mirror_error") == 0


@NO_PROMETHEUS
def test_real_prometheus_sees_each_variant_s_own_series(served, client, tmp_path):
    with prometheus(tmp_path, served.port) as (query, api):
        _wait(lambda: query('up{job="mixbit"} == 1'), timeout=60)
        _traffic(client, n=1)
        by_variant = _wait(lambda: (r := query("sum by (variant) (mixbit_fidelity_checks_total)")) and
                           len(r) == len(VARIANTS) and r)
        assert {r["metric"]["variant"] for r in by_variant} == set(VARIANTS)
        running = _wait(lambda: query("mixbit_running_sequences"))
        assert {r["metric"]["variant"] for r in running} == set(VARIANTS)
        groups = httpx.get(api + "/rules", timeout=5).json()["data"]["groups"]
        assert all(r["health"] != "err" for g in groups for r in g["rules"])


def test_a_memory_budget_refuses_variants_that_do_not_fit(tmp_path):
    s = ServerProcess("quant.variants=['uniform-4','bf16']", "server.memory_budget_bytes=2000000",
                      recipe=None, cache_dir=str(tmp_path))
    try:
        last = None
        for last in s.poll("/ready", timeout=300, every=0.5):
            if last.json()["status"] == "failed":
                break
        body = last.json()
        assert body["status"] == "failed", body
        assert "server.memory_budget_bytes" in body["detail"] and "uniform-4" in body["detail"]
        # the server stays up and says why on every route
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": NAME, "messages": OSLO})
        assert r.status_code == 503 and "memory_budget_bytes" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_distributed_serving_takes_one_variant():
    from .conftest import run_cli

    r = run_cli("serve", "--distributed", "--variants", "uniform-4,bf16", timeout=60)
    assert r.returncode == 2 and "quant.variants" in r.stderr and "distributed" in r.stderr
