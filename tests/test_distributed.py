"""One model over two MLX ranks on loopback (`mlx.launch --backend ring`, tensor-parallel shards
through mlx-lm's qwen3_5 sharding): rank 0 serves HTTP, rank 1 follows in lockstep, and the
answers are the ones a single process gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from .conftest import ROOT
from .server_proc import ServerProcess, free_port

MODEL = "tiny-qwen3.5"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
REQUESTS = [
    dict(messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=[WEATHER], temperature=0),
    dict(messages=[{"role": "user", "content": "Count from 3 to 7."}], temperature=0, max_tokens=40),
    dict(messages=[{"role": "user", "content": "Tell me a joke."}], temperature=0.9, seed=11, max_tokens=40),
    dict(messages=[{"role": "user", "content": "JSON please: name Leo, age 40."}], temperature=0,
         response_format={"type": "json_object"}),
    dict(messages=[{"role": "user", "content": "Tell me a joke."}], tools=[WEATHER], tool_choice="required",
         temperature=0),
]


class DistributedServer:
    def __init__(self, ranks: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
        self.log_path = ROOT / ".cache" / f"test-distributed-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
        self.proc = subprocess.Popen(
            [launcher, "-n", str(ranks), "--backend", "ring", "-p", str(free_port()), sys.executable, "-m",
             "mixbit.server.cli", "serve", "--distributed", "--port", str(self.port), "--recipe", "bf16"],
            cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> "DistributedServer":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def servers():
    single = ServerProcess()
    dist = DistributedServer()
    try:
        single.wait_ready()
        dist.wait_ready()
        yield single, dist
    finally:
        dist.stop()
        single.stop()


def _answer(url: str, body: dict) -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(model=MODEL, **body)
    m = r.choices[0].message
    return {"content": m.content, "calls": [(t.function.name, json.loads(t.function.arguments))
                                            for t in m.tool_calls or []],
            "finish": r.choices[0].finish_reason, "tokens": r.usage.completion_tokens}


def test_two_ranks_answer_like_one_process(servers):
    single, dist = servers
    # mlx.launch relays each rank's output on its own schedule: rank 1's line can reach the log
    # after rank 0 reported ready (a fresh-clone CI run read the log too early)
    deadline = time.time() + 30
    while "rank 1 of 2: following rank 0" not in dist.log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert "rank 1 of 2: following rank 0" in dist.log_path.read_text()
    for body in REQUESTS:
        assert _answer(dist.url, body) == _answer(single.url, body), body


def test_concurrent_requests_stay_in_lockstep(servers):
    import asyncio

    single, dist = servers

    async def burst(url):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(c.chat.completions.create(model=MODEL, **b) for b in REQUESTS))
        return [(r.choices[0].message.content, r.usage.completion_tokens) for r in rs]

    assert asyncio.run(burst(dist.url)) == asyncio.run(burst(single.url))
    # the engine is still healthy on both ranks afterwards
    assert httpx.get(dist.url + "/health").json()["status"] == "ok"
