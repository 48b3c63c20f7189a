"""Every error is OpenAI-shaped with the right status, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from .server_proc import ServerProcess
from .test_server_api import MODEL, ask, no_eos_bias

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(f"server.api_keys=['{KEY}', 'sk-second']", "server.max_body_bytes=20000",
                      "server.cors_origins=['http://app.example']",
                      "server.max_concurrent_sequences=2", "server.max_queue=1").wait_ready()
    yield s
    s.stop()


def post(server, body=None, *, content=None, key=KEY, path="/v1/chat/completions", headers=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    if content is not None:
        h.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + path, content=content, headers=h, timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def assert_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def ok_body(**kw):
    return {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4, "temperature": 0, **kw}


def test_auth(server):
    assert_error(post(server, ok_body(), key=None), 401, "invalid_api_key")
    assert_error(post(server, ok_body(), key="sk-wrong"), 401, "invalid_api_key")
    assert post(server, ok_body()).status_code == 200
    assert post(server, ok_body(), key="sk-second").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # liveness needs no key
    assert httpx.get(server.url + "/v1/models").status_code == 401
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("content, code", [
    (b'{"model": "tiny-qwen3.5", "messages": [', "invalid_json"),
    (b"\xff\xfe\x00garbage", "invalid_json"),
    (b"", None),
])
def test_malformed_bodies(server, content, code):
    assert_error(post(server, content=content), 400, code)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (ok_body(temperature=5), "temperature"),
    (ok_body(n=0), "n"),
    (ok_body(max_tokens=0), "max_tokens"),
    (ok_body(top_p=0), "top_p"),
    (ok_body(logit_bias={"abc": 1}), "logit_bias"),
    (ok_body(stop=["x"] * 17), "stop"),
    (ok_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
])
def test_bad_fields_name_the_field(server, body, param):
    assert_error(post(server, body), 400, param=param)


def test_unknown_model_is_404(server):
    assert_error(post(server, ok_body(model="/etc/passwd")), 404, "model_not_found", "model")


def test_fields_we_cannot_honour_are_rejected(server):
    assert_error(post(server, ok_body(audio={"voice": "x"})), 400, "unsupported_parameter", "audio")
    assert_error(post(server, ok_body(functions=[{"name": "f"}])), 400, "unsupported_parameter")
    # an unknown, non-OpenAI field is accepted and ignored
    assert post(server, ok_body(my_framework_field=1)).status_code == 200


def test_context_limits(server):
    err = assert_error(post(server, ok_body(max_tokens=10**9)), 400, "context_length_exceeded", "max_tokens")
    assert "context" in err["message"]
    huge = "word " * 3500  # 7000 tokens > the 4096-token context, under the body limit
    assert_error(post(server, ok_body(messages=ask(huge))), 400, "context_length_exceeded")


def test_body_too_large(server):
    r = post(server, ok_body(messages=ask("x" * 50000)))
    assert_error(r, 413, "request_too_large")


def test_logit_bias_outside_vocab(server):
    assert_error(post(server, ok_body(logit_bias={"99999999": 5})), 400, param="logit_bias")


def test_bad_tool_history(server):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{not json"}}]}]
    assert_error(post(server, ok_body(messages=msgs)), 400, param="messages[1].tool_calls[0]")
    assert_error(post(server, ok_body(messages=[{"role": "assistant", "content": "only me"}])), 400,
                 "invalid_messages")


def test_not_found_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)


def test_queue_full_is_429_with_retry_after(server):
    long = ok_body(max_tokens=400, temperature=1.0, logit_bias=no_eos_bias(),
                   messages=ask("Count from 1 to 500."))
    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: post(server, long), range(6)))
    statuses = sorted(r.status_code for r in results)
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    rejected = next(r for r in results if r.status_code == 429)
    assert_error(rejected, 429, "queue_full")
    assert int(rejected.headers["Retry-After"]) >= 1


def test_barrage_then_still_serving(server):
    bad = [b"{", b"null", b"[]", b'{"model": 1}', b'{"messages": "x"}', b"\x00" * 100,
           b'{"model": "tiny-qwen3.5", "messages": [{"role": "user", "content": null}]}',
           b'{"model": "tiny-qwen3.5", "messages": [{"role": "tool", "content": "x"}], "n": 99}']
    for _ in range(5):
        for body in bad:
            r = post(server, content=body)
            assert 400 <= r.status_code < 500
    assert post(server, ok_body()).status_code == 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_not_ready_and_failed_model_answer_503():
    s = ServerProcess("model.source=/no/such/model")
    try:
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.get(s.url + "/ready", timeout=2)
                if r.json()["status"] == "failed":
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        assert r.status_code == 503 and "/no/such/model" in r.json()["detail"]
        err = assert_error(httpx.post(s.url + "/v1/chat/completions", json=ok_body(), timeout=10), 503,
                           "model_failed")
        assert "not embedded:<name>" in err["message"]
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_before_ready_requests_get_503_with_retry_after():
    s = ServerProcess()
    try:
        seen = list(s.poll("/v1/models"))
    finally:
        s.stop()
    assert seen and seen[-1].status_code == 200
    for r in seen[:-1]:
        assert_error(r, 503, "model_not_ready")
        assert r.headers["Retry-After"]


def test_cors_only_for_configured_origins(server):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre)
    assert r.headers.get("access-control-allow-origin") == "http://app.example"
    r = httpx.options(server.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert r.headers.get("access-control-allow-origin") is None
