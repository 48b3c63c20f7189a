"""Progress of a long first start: the stage, step k of n, and an ETA, for /ready, the CLI, the
log and a Prometheus gauge. One `Progress` is handed down the quantization pipeline; whoever
started it reads `snapshot()` or listens with `on_update`."""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Snapshot:
    stage: str = ""
    step: int = 0
    total: int = 0
    message: str = ""
    stage_elapsed_s: float = 0.0
    eta_s: float | None = None  # of this stage, from its pace so far
    elapsed_s: float = 0.0

    def line(self) -> str:
        out = f"{self.stage}: {self.step}/{self.total}" if self.total else self.stage
        if self.message:
            out += f" ({self.message})"
        if self.eta_s is not None:
            out += f", ETA {self.eta_s:.0f}s"
        return out

    def as_dict(self) -> dict:
        return {"stage": self.stage, "step": self.step, "total": self.total, "message": self.message,
                "stage_elapsed_s": round(self.stage_elapsed_s, 1),
                "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
                "elapsed_s": round(self.elapsed_s, 1)}


@dataclass
class Progress:
    """Thread-safe: the loader thread writes, request handlers and scrapes read."""
    on_update: Callable[[Snapshot], None] | None = None
    log_every_s: float = 5.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started: float = field(default_factory=time.time)
    _stage_started: float = field(default_factory=time.time)
    _snap: Snapshot = field(default_factory=Snapshot)
    _last_log: float = 0.0
    stage_seconds: dict = field(default_factory=dict)  # finished stages and how long they took
    peak_rss_gb: dict = field(default_factory=dict)  # the process's peak RSS when each stage ended
    memory: dict = field(default_factory=dict)  # the first start's memory plan (quant/memory.py)
    peak_anon_gb: dict = field(default_factory=dict)  # sampled peak anonymous memory per stage
    sample_every_s: float = 0.2
    _sampler: threading.Thread | None = None

    def stage(self, name: str, total: int = 0, message: str = "") -> None:
        if self._sampler is None and name:  # holds the Progress weakly: ends with it
            self._sampler = threading.Thread(target=_sample, args=(weakref.ref(self),),
                                             name="mixbit-memory", daemon=True)
            self._sampler.start()
        with self._lock:
            now = time.time()
            if self._snap.stage and self._snap.stage != name:
                self.stage_seconds[self._snap.stage] = round(
                    self.stage_seconds.get(self._snap.stage, 0.0) + now - self._stage_started, 1)
                self.peak_rss_gb[self._snap.stage] = round(_peak_rss_gb(), 2)
            self._stage_started = now
            self._snap = Snapshot(stage=name, total=total, message=message)
        self._emit(force=True)

    def sample_memory(self, anon: int) -> bool:
        """Records `anon` bytes against the running stage; False once the Progress finished."""
        with self._lock:
            stage = self._snap.stage
            if stage:
                gb = round(anon / 1e9, 2)
                if gb > self.peak_anon_gb.get(stage, 0.0):
                    self.peak_anon_gb[stage] = gb
                return True
            return not self.stage_seconds

    def step(self, k: int, total: int | None = None, message: str = "") -> None:
        with self._lock:
            self._snap.step = k
            if total is not None:
                self._snap.total = total
            if message:
                self._snap.message = message
        self._emit(force=k == self._snap.total)

    def say(self, message: str) -> None:
        with self._lock:
            self._snap.message = message
        self._emit(force=True)

    def finish(self) -> dict:
        self.stage("")
        return dict(self.stage_seconds)

    def snapshot(self) -> Snapshot:
        with self._lock:
            s = Snapshot(**{k: getattr(self._snap, k) for k in ("stage", "step", "total", "message")})
            now = time.time()
            s.stage_elapsed_s = now - self._stage_started
            s.elapsed_s = now - self._started
            if s.total and s.step:
                s.eta_s = s.stage_elapsed_s / s.step * (s.total - s.step)
            return s

    def _emit(self, force: bool) -> None:
        now = time.time()
        if self.on_update is None or (not force and now - self._last_log < self.log_every_s):
            return
        self._last_log = now
        self.on_update(self.snapshot())


def _sample(ref: "weakref.ref[Progress]") -> None:
    """Anonymous memory (what the kernel cannot drop) sampled while stages run: the peak of
    each stage lands in recipe.json, for the memory plan to be checked against. Ends when the
    Progress finishes or is dropped (a failed first start)."""
    from .memory import anon_bytes

    while True:
        progress = ref()
        if progress is None or not progress.sample_memory(anon_bytes()):
            return
        every = progress.sample_every_s
        del progress
        time.sleep(every)


def _peak_rss_gb() -> float:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return peak / (1e9 if sys.platform == "darwin" else 1e6)


def from_callback(say: Callable[[str], None] | None) -> Progress:
    """A Progress that reports its lines to an old-style `say(str)` callback."""
    return Progress(on_update=(lambda snap: say(snap.line())) if say else None)
