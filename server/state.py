"""What the running server knows: settings, start-up status, the loaded model and engine, and
the counters the routes share. Its own module so that app.py, planning.py and serving.py all
import it from below."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mixbit.models.grammar import GrammarEngine
from mixbit.models.loading import LoadedModel
from mixbit.quant.progress import Progress

from .engine import Engine
from .fidelity import FidelityWorker
from .metrics import Metrics
from .responses import ResponseStore
from .settings import Settings


@dataclass
class ServerState:
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

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self.engine is not None and self.engine.alive
