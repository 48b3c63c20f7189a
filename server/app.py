"""The FastAPI app: start-up (resolve, quantize, load; distributed followers), middleware and
limits, and the routers of server/routes (one per API; what they share is in deps.py).
Planning lives in planning.py, running and response shapes in serving.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from mixbit.models.blas import release_free_memory
from mixbit.models.chat.grammar import GrammarEngine
from mixbit.models.forward.plan import plan_path
from mixbit.models.kernels import SMALL
from mixbit.models.loading import load
from mixbit.models.registry import ModelSourceError, resolve
from mixbit.quant.progress import Progress
from mixbit.quant.variants import ensure_variant

from . import errors
from .engine import Engine
from .fidelity import FidelityWorker, LocalReference, RemoteReference
from .metrics import Metrics
from .middleware import CatchAll, CheckBody, CountRequests
from .routes import ROUTERS
from .settings import Settings
from .speculative import Speculation, crossover, draft_vocabulary
from .state import ServerState

log = logging.getLogger("mixbit.server")


def served_name(settings: Settings, resolved) -> str:
    return settings.model.served_name or resolved.name


def ensure_shared_variant(s: Settings, resolved, progress, group=None, label: str | None = None):
    """ensure_variant of the variant `label` (default: the first configured); in a distributed
    group rank 0 quantizes first and the others then find the verified entry (same host) or build
    the identical one (their own host)."""
    recipe, bpw = s.quant.spec(label or s.quant.labels()[0])

    def ensure():
        return ensure_variant(resolved, recipe, s.model.cache_dir, progress, target_bpw=bpw,
                              calibration=s.quant.calibration or None,
                              sensitivity=s.quant.sensitivity,
                              sensitivity_seconds=s.quant.sensitivity_seconds,
                              memory_gb=s.quant.memory_gb)

    if group is None or group.size() == 1:
        return ensure()
    import mlx.core as mx

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))

    if group.rank() == 0:
        variant = ensure()
        barrier()
        return variant
    barrier()
    return ensure()


def plan_dir(s: Settings) -> Path:
    """Where measured CPU plans are kept (models/forward/plan.py): beside the variants."""
    return Path(s.model.cache_dir).expanduser() / "cpu-plans"


def follow(settings: Settings, group) -> int:
    """A rank > 0 of `mixbit serve --distributed`: loads its shard and mirrors rank 0's engine."""
    s = settings
    resolved = resolve(s.model.source, s.model.revision, s.model.hub_cache_dir or None,
                       s.model.allow_download)
    variant = ensure_shared_variant(s, resolved, log.info, group)
    lm = load(resolved, s.generation.compute_dtype, path=variant.path, group=group,
              cpu_quantized=s.generation.cpu_quantized,
              cpu_activations=s.generation.cpu_activations, plan_dir=plan_dir(s))
    text_cfg = lm.config.get("text_config", lm.config)
    grammar = GrammarEngine(lm.hf_tokenizer, int(text_cfg["vocab_size"]),
                            sorted(lm.tokenizer.eos_token_ids))
    engine = Engine(lm.model, lm.tokenizer, max_batch=s.server.max_concurrent_sequences,
                    prefill_tokens=s.server.prefill_tokens,
                    cache_entries=s.server.prefix_cache_entries,
                    cache_bytes=s.server.prefix_cache_bytes, model_key=served_name(s, resolved),
                    group=group, grammar_engine=grammar)
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    engine.run_follower()
    log.info("rank %d: rank 0 stopped; exiting", group.rank())
    return 0


def speculation(s) -> Speculation | None:
    """`generation.mtp*`: drafting with the checkpoint's MTP head (server/speculative.py)."""
    g = s.generation
    return Speculation(drafts=g.mtp_drafts, vocab=g.mtp_draft_vocab) if g.mtp is not False else None


def decide_speculation(s, model, hf_tokenizer, folder, group) -> tuple[Speculation | None, dict | None]:
    """The drafting a variant is served with, and (with `generation.mtp = "auto"`) the measured
    crossover it was decided by: drafting where a drafting step pays at the expected acceptance
    on this machine, measured once per variant and kept beside its CPU plan."""
    spec = speculation(s) if group is None or group.size() == 1 else None
    if spec is None or getattr(model, "mtp", None) is None:
        return spec, None
    draft_over(model, hf_tokenizer, spec)
    if s.generation.mtp != "auto":
        return spec, None
    plan = plan_path(plan_dir(s), folder, s.generation.cpu_quantized, s.generation.cpu_activations, SMALL)
    try:
        measured = crossover(model, spec.drafts, plan.with_name(plan.stem + "-mtp.json"), spec.vocab)
    except Exception as exc:  # a measurement that fails never stops start-up: serve without drafts
        log.warning("MTP drafting off: its crossover could not be measured (%s)", exc)
        return None, {"error": str(exc), "pays": False}
    log.info("MTP drafting %s: a drafting step %.1f ms against %.1f plain, breaks even at acceptance %s",
             "on" if measured["pays"] else "off", measured["drafting_step_ms"], measured["plain_step_ms"],
             measured["break_even_acceptance"])
    return (spec if measured["pays"] else None), measured


def draft_over(model, hf_tokenizer, spec: Speculation | None) -> None:
    """The MTP head drafts over the `spec.vocab` most frequent tokens (FR-Spec), where that is
    fewer than the vocabulary."""
    if spec is not None and spec.vocab and getattr(model, "mtp", None) is not None:
        model.set_draft_vocab(draft_vocabulary(hf_tokenizer, spec.vocab))


def speculative_card(engine: Engine, model, measured: dict | None = None) -> dict:
    """What /v1/models says of drafting: on (the MTP head drafts `drafts` tokens a step while one
    sequence decodes), or off and why; with the measured crossover where "auto" decided."""
    if getattr(model, "mtp", None) is None:
        return {"method": None, "reason": "the checkpoint has no MTP head"}
    if engine.speculate is None:
        reason = ("not across distributed ranks" if engine.group is not None else
                  "generation.mtp is off" if measured is None else
                  "generation.mtp is auto and its crossover could not be measured" if "error" in measured else
                  "generation.mtp is auto and drafting measured slower here")
        return {"method": None, "reason": reason, **({"crossover": measured} if measured else {})}
    vocab = getattr(model, "draft_vocab", None)
    return {"method": "mtp", "drafts": engine.speculate.drafts, "max_batch": 1,
            "draft_vocab": int(vocab.ids.size) if vocab is not None else "all",
            **({"crossover": measured} if measured else {})}


class StartupRefused(RuntimeError):
    """Settings that cannot be served as they are (the message says which and why)."""


def model_bytes(model) -> int:
    """Bytes the model's arrays hold (packed weights as packed, dense copies as dense)."""
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


class MemoryBudget:
    """server.memory_budget_bytes over the served variants and an in-process bf16 reference."""

    def __init__(self, budget: int, reference_bytes: int):
        self.budget = budget
        self.reference_bytes = reference_bytes  # 0: none in process (or it is a served variant)
        self.held: dict[str, int] = {}

    def check(self, label: str, nbytes: int, estimate: bool) -> None:
        total = sum(self.held.values()) + nbytes + self.reference_bytes
        if not self.budget or total <= self.budget:
            return
        parts = [f"{k} {v / 1e6:.1f} MB" for k, v in self.held.items()]
        parts.append(f"{label} {nbytes / 1e6:.1f} MB{' (its files, before loading)' if estimate else ''}")
        if self.reference_bytes:
            parts.append(f"the in-process bf16 reference ~{self.reference_bytes / 1e6:.1f} MB")
        raise StartupRefused(
            f"the variants do not fit server.memory_budget_bytes={self.budget} "
            f"({self.budget / 1e6:.1f} MB): {', '.join(parts)} = {total / 1e6:.1f} MB; raise the "
            "budget, serve fewer variants, or point fidelity.reference at a bf16 instance")

    def add(self, label: str, nbytes: int) -> None:
        self.check(label, nbytes, estimate=False)
        self.held[label] = nbytes


def _reference_bytes(s: Settings, resolved, labels: list[str]) -> int:
    """What an in-process bf16 reference will hold, or 0 (checks off, a remote reference, or bf16
    among the served variants: that variant is the reference)."""
    f = s.fidelity
    if not f.enabled or f.reference.strip() != "auto" or "bf16" in labels or resolved.quantized:
        return 0
    import mlx.core as mx

    files = _weights_bytes(resolved.path)
    return 2 * files if mx.default_device() == mx.cpu else files  # bf16 files, float32 on CPU


def _variant_ids(s: Settings, resolved, labels: list[str]) -> list[str]:
    name = served_name(s, resolved)
    return [name] if len(labels) == 1 else [f"{name}:{label}" for label in labels]


def start_loading(state: ServerState) -> threading.Thread:
    """Resolves, quantizes and loads every variant off the event loop; /ready reports progress."""
    def work():
        s = state.settings
        try:
            state.status, state.detail = "resolving", f"resolving {s.model.source}"
            resolved = resolve(s.model.source, s.model.revision, s.model.hub_cache_dir or None,
                               s.model.allow_download)
            labels = s.quant.labels()
            if len(labels) > 1 and resolved.quantized:
                raise StartupRefused(f"{s.model.source} is already quantized and is served as it is; "
                                     "quant.variants needs an unquantized source")
            if len(labels) > 1 and state.group is not None and state.group.size() > 1:
                raise StartupRefused("quant.variants serves one variant per engine in one process; "
                                     "distributed serving takes one variant")
            budget = MemoryBudget(s.server.memory_budget_bytes, _reference_bytes(s, resolved, labels))
            grammar = None
            for label, served_id in zip(labels, _variant_ids(s, resolved, labels)):
                state.status = "quantizing"

                def update(snap) -> None:
                    state.detail = snap.line()
                    log.info(state.detail)

                state.startup = Progress(on_update=update)
                variant = ensure_shared_variant(s, resolved, state.startup, state.group, label)
                state.startup = None
                budget.check(label, _weights_bytes(variant.path), estimate=True)
                state.status, state.detail = "loading", f"loading {variant.path}"
                lm = load(resolved, s.generation.compute_dtype, path=variant.path, group=state.group,
                          cpu_quantized=s.generation.cpu_quantized,
                          cpu_activations=s.generation.cpu_activations, plan_dir=plan_dir(s))
                if state.variants:  # the same source's tokenizer: one copy serves every variant
                    lm.tokenizer = state.variants[0].lm.tokenizer
                    lm.hf_tokenizer = state.variants[0].lm.hf_tokenizer
                budget.add(label, model_bytes(lm.model))
                text_cfg = lm.config.get("text_config", lm.config)
                if grammar is None:  # one grammar engine (and its compiled-grammar cache) for all
                    grammar = GrammarEngine(lm.hf_tokenizer, int(text_cfg["vocab_size"]),
                                            sorted(lm.tokenizer.eos_token_ids))
                v = ServerState(settings=s, status="ready", metrics=state.metrics,
                                responses=state.responses, group=state.group, created=state.created,
                                served_id=served_id, lm=lm, grammar=grammar,
                                variant=variant.recipe if resolved.quantized else label,
                                context_length=int(text_cfg.get("max_position_embeddings", 4096)),
                                provenance={**variant.manifest, "model_type": resolved.model_type,
                                            "path": str(variant.path),
                                            # how each layer shape runs on the CPU (docs/cpu-serving.md)
                                            **({"cpu_plan": lm.cpu_plan} if lm.cpu_plan else {})})
                itl = state.metrics.itl.labels(v.variant).observe if state.metrics else None
                spec, measured = decide_speculation(s, lm.model, lm.hf_tokenizer, variant.path, state.group)
                v.engine = Engine(lm.model, lm.tokenizer, max_batch=s.server.max_concurrent_sequences,
                                  prefill_tokens=s.server.prefill_tokens,
                                  cache_entries=s.server.prefix_cache_entries,
                                  cache_bytes=s.server.prefix_cache_bytes, model_key=served_id,
                                  on_token_gap=itl, group=state.group, grammar_engine=grammar,
                                  speculate=spec)
                v.provenance["speculative"] = speculative_card(v.engine, lm.model, measured)
                v.engine.start()
                if state.metrics is not None:
                    state.metrics.set_variant(v.variant, v.provenance)
                state.variants.append(v)
                log.info("loaded %s as %r", variant.path, served_id)
            first = state.variants[0]
            aliases = {v.served_id: v for v in state.variants}
            aliases.update({f"{served_name(s, resolved)}:{v.variant}": v for v in state.variants})
            aliases.setdefault(served_name(s, resolved), first)
            state.aliases = aliases
            _wire_mirrors(state)
            worker = _fidelity_worker(state, resolved)
            for v in state.variants:
                v.fidelity = worker
            state.fidelity = worker
            release_free_memory()  # what loading freed, back to the system before serving
            state.status, state.detail = "ready", ""
            log.info("ready: serving %s", ", ".join(repr(v.served_id) for v in state.variants))
        except (ModelSourceError, StartupRefused) as exc:
            _stop_engines(state)
            state.status, state.detail = "failed", str(exc)
            log.error("cannot serve: %s", exc)
        except Exception as exc:  # noqa: BLE001 - reported on /ready and in the log
            _stop_engines(state)
            state.status, state.detail = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("start-up failed")

    t = threading.Thread(target=work, name="mixbit-loader", daemon=True)
    t.start()
    return t


def _wire_mirrors(state: ServerState) -> None:
    """fidelity.mirror_rate: each variant's mirror (fidelity.mirror_to, or the next variant)."""
    f = state.settings.fidelity
    if not f.mirror_rate:
        return
    vs = state.variants
    if len(vs) < 2:
        log.warning("fidelity.mirror_rate is set but one variant is served: nothing to mirror to")
        return
    labels = [v.variant for v in vs]
    if f.mirror_to and f.mirror_to not in labels:
        raise StartupRefused(f"fidelity.mirror_to {f.mirror_to!r} is not served; served: {', '.join(labels)}")
    for i, v in enumerate(vs):
        target = next((w for w in vs if w.variant == f.mirror_to), None) if f.mirror_to else None
        v.mirror = target if target is not None and target is not v else vs[(i + 1) % len(vs)]
    log.info("mirroring %.0f%% of chat requests: %s", 100 * f.mirror_rate,
             ", ".join(f"{v.variant} -> {v.mirror.variant}" for v in vs))


def _stop_engines(state: ServerState) -> None:
    for v in state.variants:
        if v.engine is not None:
            v.engine.close()
    state.variants.clear()
    state.aliases = {}


def _weights_bytes(folder) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _fidelity_worker(state: ServerState, resolved) -> FidelityWorker | None:
    """The one spot-check worker for every served variant, or None when checks are off."""
    f = state.settings.fidelity
    if not f.enabled or state.metrics is None:
        return None
    if state.group is not None and state.group.size() > 1:
        # a check runs the served model outside the lockstep engine; with tensor-parallel
        # shards that would need the other ranks too
        log.warning("fidelity spot checks are off in distributed serving: the served model is "
                    "sharded across ranks; run checks on a single-process replica")
        return None
    ref = f.reference.strip()
    disabled = None
    if ref.startswith(("http://", "https://")):
        reference = RemoteReference(ref, f.reference_api_key, f.top_k)
    else:
        if ref == "auto":
            if resolved.quantized:
                source, folder = None, None
                disabled = ("the served checkpoint is already quantized and its unquantized source "
                            "is unknown; set fidelity.reference")
            else:
                source, folder = resolved, resolved.path
        else:
            source = resolve(ref, allow_download=False)
            folder = source.path
        served = next((v for v in state.variants
                       if folder is not None and str(folder) == v.provenance.get("path")), None)
        if served is not None:  # bf16 is served: that variant is the reference
            reference = LocalReference(lambda: served.lm.model, f"the served {served.variant} model")
        else:
            dtype = state.settings.generation.compute_dtype
            reference = LocalReference(lambda: load(source, dtype, plan_dir=plan_dir(state.settings)).model,
                                       f"{getattr(source, 'source', ref)} (unquantized, in process)")
            need = 2 * _weights_bytes(folder) if folder else 0  # bf16 files, float32 on CPU
            if f.reference_max_bytes and need > f.reference_max_bytes:
                disabled = (f"the reference needs about {need} bytes, over "
                            f"fidelity.reference_max_bytes ({f.reference_max_bytes}); point "
                            "fidelity.reference at a bf16 instance instead")
    worker = FidelityWorker(reference, state.metrics,
                            sample_rate=f.sample_rate, max_per_minute=f.max_per_minute,
                            queue_size=f.queue_size, max_tokens=f.max_tokens, keep=f.keep,
                            busy=state.busy, busy_share=f.busy_share, chunk=f.chunk_tokens)
    worker.disabled = disabled
    if disabled:
        log.warning("fidelity spot checks disabled: %s", disabled)
    worker.start()
    log.info("fidelity spot checks: %.0f%% of requests (at most %d a minute) against %s",
             100 * f.sample_rate, f.max_per_minute, reference.describe)
    return worker


def create_app(settings: Settings, *, load_model: bool = True, group=None) -> FastAPI:
    state = ServerState(settings=settings, group=group)
    state.metrics = Metrics(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_model:
            start_loading(state)
        yield
        state.draining = True
        deadline = time.monotonic() + settings.server.shutdown_grace_s
        while any(v.inflight for v in state.variants) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for v in state.variants:
            v.engine.close()
        if state.fidelity is not None:
            state.fidelity.close()

    app = FastAPI(title="mixbit", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible server for mixed-bit quantized Qwen3.5")
    app.state.mixbit = state
    errors.install(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins,
                           allow_methods=["*"], allow_headers=["*"])
    # innermost first: the last added runs first
    app.add_middleware(CatchAll)
    app.add_middleware(CheckBody, limit=settings.server.max_body_bytes)
    app.add_middleware(CountRequests, metrics=state.metrics)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mixbit")
    except PackageNotFoundError:
        return "0"
