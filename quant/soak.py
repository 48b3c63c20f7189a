"""The agent soak through the served Anthropic Messages API.

What broke community quants of Qwen3.5 was seen through an Anthropic-compatible endpoint: after a
few rounds of an agent loop, tool calls came back as plain text. This soak runs that loop against a
real `mixbit serve` process serving the variant (its kernels, its chat template, its parser and,
in "grammar" mode, its tool grammar): request -> `tool_use` -> `tool_result` -> answer -> next
request, until a round leaks tool-call markup into text or stops calling tools, `max_rounds` pass,
or the conversation no longer fits the context. The user and the tools are `evaluate.SoakScript`,
the same script the in-process soak plays.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mixbit.models.chat.toolcall import leaks_markup

from .evaluate import SoakResult, SoakScript

MODES = {"free": False, "grammar": True}  # generation.tool_grammar of the served variant
ROOM = 200  # tokens kept free for a call and its answer; a fuller conversation counts as "context full"


class SoakServerError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(path: Path, tool_grammar: bool, log_path: Path, timeout: float = 600):
    """Base URL of a `mixbit serve` process serving the model folder `path` on a free loopback
    port; stopped on exit. Fidelity checks are off: the soak measures the variant, not them."""
    port = _free_port()
    args = [sys.executable, "-m", "mixbit.server.cli", "serve", "--model", str(path),
            "--port", str(port), "--set", "fidelity.enabled=false",
            "--set", f"generation.tool_grammar={'true' if tool_grammar else 'false'}",
            "--recipe", "bf16"]  # a quantized folder is served as it is whatever the recipe
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise SoakServerError(f"mixbit serve exited ({proc.returncode}); see {log_path}")
                if time.time() > deadline:
                    raise SoakServerError(f"mixbit serve not ready after {timeout:.0f} s; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                time.sleep(0.3)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def messages_soak(url: str, max_rounds: int = 70, seed: int = 77, n_tools: int = 4,
                  api_key: str | None = None, timeout: float = 600) -> SoakResult:
    """The agent loop against the `/v1/messages` of the server at `url`, greedy. A round that
    breaks is counted and the loop goes on (the next user turn answers any tool call it made), so
    the result has both the first round that broke and how many of the rounds played did."""
    script = SoakScript(seed, n_tools)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in script.tools]
    headers = {"anthropic-version": "2023-06-01", **({"x-api-key": api_key} if api_key else {})}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
        def post(path: str, body: dict) -> dict:
            r = client.post(path, json=body)
            if r.status_code != 200:
                raise SoakServerError(f"POST {path}: {r.status_code} {r.text[:300]}")
            return r.json()

        card = client.get("/v1/models").json()["data"][0]
        model, context = card["id"], card["max_model_len"]
        messages: list[dict] = []
        right = used = played = failed = 0
        first: tuple[int, str, str] | None = None  # the first round that broke, why, what came back
        owed: list[dict] = []  # tool_result blocks a broken round still owes the next user turn

        def ask(max_tokens: int) -> tuple[list[str], list[dict]]:
            reply = post("/v1/messages", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                          "tools": tools, "messages": messages})
            if reply["content"]:  # an empty turn is not resent (the API refuses empty content)
                messages.append({"role": "assistant", "content": reply["content"]})
            return ([b["text"] for b in reply["content"] if b["type"] == "text"],
                    [b for b in reply["content"] if b["type"] == "tool_use"])

        def dropped_calls() -> float:
            """The server's count of tool calls it could not parse (and so did not return)."""
            text = client.get("/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("mixbit_tool_call_outcomes_total") and 'outcome="parse_failed"' in line)

        def results(calls: list[dict]) -> list[dict]:
            return [{"type": "tool_result", "tool_use_id": c["id"],
                     "content": script.result(c["name"], c["input"])} for c in calls]

        for round_no in range(1, max_rounds + 1):
            request = script.request()
            messages.append({"role": "user", "content": owed + [{"type": "text", "text": request}]
                             if owed else request})
            owed = []
            used = post("/v1/messages/count_tokens", {"model": model, "tools": tools,
                                                      "messages": messages})["input_tokens"]
            if used + ROOM > context:
                messages.pop()
                break
            played += 1
            reason = None
            texts, calls = ask(96)
            if any(leaks_markup(t) for t in texts):
                reason, owed = "markup in text", results(calls)
            elif not calls:
                reason = "no tool call"
            else:
                right += script.right(calls[0]["name"], calls[0]["input"])
                messages.append({"role": "user", "content": results(calls)})
                before = dropped_calls()
                texts, calls = ask(64)
                if calls or any(leaks_markup(t) for t in texts):
                    reason, owed = "tool call instead of an answer", results(calls)
                elif not "".join(texts).strip():
                    # an empty answer is often a call the server could not parse and dropped
                    reason = ("unparsable tool call instead of an answer" if dropped_calls() > before
                              else "empty answer")
            if reason:  # counted, and the loop goes on as an agent's user would
                failed += 1
                if first is None:
                    last = messages[-1]["content"] if messages[-1]["role"] == "assistant" else []
                    first = (round_no, reason, json.dumps(last)[:1000])
    full = played < max_rounds
    if first is None:
        return SoakResult(played, None, "context full" if full else "", right, used,
                          played=played, failed=0)
    return SoakResult(first[0] - 1, first[0], first[1], right, used, first[2], played=played, failed=failed)


def soak_variant(path: Path, work: Path, name: str, max_rounds: int = 70,
                 progress=print) -> dict[str, dict]:
    """Both modes for one variant folder: {"free": SoakResult fields, "grammar": ...}."""
    out = {}
    for mode, grammar in MODES.items():
        log_path = work / f"soak-{name.replace('/', '_')}-{mode}.log"
        with served(path, grammar, log_path) as url:
            out[mode] = messages_soak(url, max_rounds=max_rounds).__dict__
        r = out[mode]
        progress(f"{name} soak ({mode}): " + (f"first broke at round {r['broke_at']} ({r['reason']}), "
                 f"{r['failed']} of {r['played']} rounds broke" if r["broke_at"] else
                 f"none of {r['played']} rounds broke" + (f" ({r['reason']})" if r["reason"] else "")))
    return out
