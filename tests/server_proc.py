"""Starts the real `mixbit serve` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from .conftest import ROOT


def metric_value(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples in Prometheus text (over the label sets matching `labels`)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *settings: str, env: dict | None = None, recipe: str | None = "bf16",
                 cache_dir: str | None = None):
        """`recipe` bf16 keeps start-up fast for API tests; quantized start-ups have their own;
        None: the configured default (config.toml), as `make serve` runs it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "mixbit.server.cli", "serve", "--port", str(self.port)]
        if recipe is not None:
            args += ["--recipe", recipe]
        if cache_dir:
            args += ["--set", f"model.cache_dir='{cache_dir}'"]
        for s in settings:
            args += ["--set", s]
        base = {k: v for k, v in os.environ.items() if not k.startswith("MIXBIT_")}
        self.log_path = ROOT / ".cache" / f"test-server-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**base, "HF_HUB_OFFLINE": "1", **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready: {self.log_path.read_text()[-3000:]}")

    def poll(self, path: str, timeout: float = 120, every: float = 0.05):
        """Responses of GET `path`, one every `every` seconds, until one is 200 (the last one
        yielded) or `timeout` passes; connection errors before the port opens are skipped."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                r = httpx.get(self.url + path, timeout=2)
            except httpx.HTTPError:
                time.sleep(every)
                continue
            yield r
            if r.status_code == 200:
                return
            time.sleep(every)

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
