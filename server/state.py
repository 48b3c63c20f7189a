"""What the running server knows: settings, start-up status, the served variants (each with its
model, engine and id), and what the routes share. Its own module so that app.py, planning.py and
serving.py all import it from below."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mixbit.models.chat.grammar import GrammarEngine
from mixbit.models.loading import LoadedModel
from mixbit.quant.progress import Progress

from .engine import Engine
from .fidelity import FidelityWorker
from .metrics import Metrics
from .responses import ResponseStore
from .settings import Settings


@dataclass
class ServerState:
    """The server's state, and also the shape of each served variant's: a variant's state shares
    the server's settings, metrics, fidelity worker, grammar engine and response store and has its
    own model, engine, id and in-flight count. The routes plan and run against a variant's state."""
    settings: Settings
    status: str = "starting"  # starting -> resolving -> quantizing -> loading -> ready | failed
    detail: str = ""
    started: float = field(default_factory=time.time)
    lm: LoadedModel | None = None
    engine: Engine | None = None
    grammar: GrammarEngine | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)
    metrics: Metrics | None = None
    fidelity: FidelityWorker | None = None
    group: Any = None  # mx.distributed group when serving one model over several ranks
    served_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    provenance: dict = field(default_factory=dict)
    context_length: int = 4096
    inflight: int = 0
    draining: bool = False
    startup: Progress | None = None  # quantization progress during a first start
    variant: str = ""  # a variant's label, e.g. "uniform-4" (the `variant` of its metrics)
    variants: list["ServerState"] = field(default_factory=list)  # the server's: the default first
    aliases: dict[str, "ServerState"] = field(default_factory=dict)  # the server's: model id -> variant
    mirror: "ServerState | None" = None  # a variant's: where fidelity.mirror_rate re-runs its requests

    @property
    def ready(self) -> bool:
        if self.variants:  # the server: every variant loaded and its engine running
            return self.status == "ready" and all(v.ready for v in self.variants)
        return self.status == "ready" and self.engine is not None and self.engine.alive

    def busy(self) -> bool:
        """Whether any engine has sequences to decode (the fidelity checks then yield)."""
        engines = [v.engine for v in self.variants] or [self.engine]
        return any(e is not None and (e.stats.running > 0 or e.stats.waiting > 0) for e in engines)
