"""Prometheus metrics of one server: serving, tool calls, grammar, and live fidelity.

prometheus-client conventions: base units in names (`_seconds`, `_bytes`), `_total` counters,
histograms for latencies, low-cardinality labels only (endpoint, status class, request kind,
variant: every series of a served model carries its variant, so variants served side by side
compare on one dashboard). Gauges that mirror engine state are read at scrape time by a
collector, so the hot path never updates them.
"""

from __future__ import annotations

import os
import resource

from prometheus_client import (CollectorRegistry, Counter, Histogram, Info,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: half the series, nothing a dashboard uses

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
KLD = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3)
RATIO = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
POSITION = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS is what there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        st = self.state
        g = GaugeMetricFamily
        families = {
            "queue_depth": g("mixbit_queue_depth", "Sequences waiting for a batch slot", labels=["variant"]),
            "running": g("mixbit_running_sequences", "Sequences in the decode batch", labels=["variant"]),
            "batch": g("mixbit_batch_size", "Sequences in the last decode step", labels=["variant"]),
            "inflight": g("mixbit_inflight_requests_sequences", "Sequences admitted and not yet finished",
                          labels=["variant"]),
            "hit": g("mixbit_prefix_cache_hit_ratio", "Share of prompt tokens served from the prefix "
                     "cache", labels=["variant"]),
            "cache": g("mixbit_prefix_cache_bytes", "Bytes held by the prefix cache", labels=["variant"]),
        }
        for v in st.variants:  # one series per served variant (listed once its engine runs)
            stats = v.engine.stats
            prompt = stats.prompt_tokens_total + stats.cached_tokens_total
            values = {"queue_depth": stats.waiting, "running": stats.running,
                      "batch": stats.last_batch_size, "inflight": v.inflight,
                      "hit": (stats.cached_tokens_total / prompt) if prompt else 0.0,
                      "cache": stats.prefix_cache_bytes}
            for key, fam in families.items():
                fam.add_metric([v.variant], values[key])
        yield from families.values()
        yield from spec_families(st.variants)
        yield g("mixbit_memory_bytes", "Resident memory of the server process", value=_rss_bytes())
        try:
            import mlx.core as mx

            yield g("mixbit_mlx_active_memory_bytes", "Memory MLX holds for arrays",
                    value=mx.get_active_memory())
            yield g("mixbit_mlx_cache_memory_bytes", "Freed buffers MLX keeps for reuse",
                    value=mx.get_cache_memory())
        except Exception:  # noqa: BLE001 - a backend without memory stats
            pass
        yield g("mixbit_ready", "1 when the model is loaded and serving", value=1 if st.ready else 0)
        if st.startup is not None:
            snap = st.startup.snapshot()
            if snap.stage:
                done = g("mixbit_startup_progress_ratio", "Share of the current start-up stage "
                         "done (step k of n)", labels=["stage"])
                done.add_metric([snap.stage], snap.step / snap.total if snap.total else 0.0)
                yield done
                eta = g("mixbit_startup_eta_seconds", "Estimated seconds left in the current "
                        "start-up stage", labels=["stage"])
                eta.add_metric([snap.stage], snap.eta_s if snap.eta_s is not None else float("nan"))
                yield eta
        fid = st.fidelity
        if fid is not None:
            yield g("mixbit_fidelity_queue_depth", "Spot checks waiting for the reference",
                    value=fid.queue.qsize())


def spec_families(variants):
    """Speculative decoding with the MTP head (server/speculative.py), with vLLM's meanings:
    steps that drafted, tokens drafted, drafts accepted, and accepted drafts by position."""
    c = CounterMetricFamily
    drafts = c("mixbit_spec_decode_num_drafts", "Decode steps that drafted with the MTP head", labels=["variant"])
    tokens = c("mixbit_spec_decode_num_draft_tokens", "Tokens drafted by the MTP head", labels=["variant"])
    accepted = c("mixbit_spec_decode_num_accepted_tokens", "Drafted tokens the model accepted",
                 labels=["variant"])
    per_pos = c("mixbit_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position "
                "in the step's draft (0: the first)", labels=["variant", "position"])
    for v in variants:
        sc = v.engine.spec_counters
        drafts.add_metric([v.variant], sc.drafts)
        tokens.add_metric([v.variant], sc.draft_tokens)
        accepted.add_metric([v.variant], sc.accepted_tokens)
        for pos, n in enumerate(sc.accepted_per_position):
            per_pos.add_metric([v.variant, str(pos)], n)
    return [drafts, tokens, accepted, per_pos]


class Metrics:
    def __init__(self, state):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mixbit_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("mixbit_time_to_first_token_seconds", "Time from request to first token",
                              ["endpoint", "variant"], buckets=LATENCY, registry=r)
        self.itl = Histogram("mixbit_inter_token_latency_seconds", "Time between tokens of a sequence",
                             ["variant"], buckets=ITL, registry=r)
        self.e2e = Histogram("mixbit_request_duration_seconds", "Request latency, end to end",
                             ["endpoint", "variant"], buckets=LATENCY, registry=r)
        self.prompt_tokens = Counter("mixbit_prompt_tokens", "Prompt tokens processed", ["variant"],
                                     registry=r)
        self.cached_tokens = Counter("mixbit_cached_prompt_tokens", "Prompt tokens served from cache",
                                     ["variant"], registry=r)
        self.generation_tokens = Counter("mixbit_generation_tokens", "Tokens generated", ["variant"],
                                         registry=r)
        self.grammar_compile = Histogram("mixbit_grammar_compile_seconds",
                                         "Grammar compile time (cache misses)",
                                         buckets=(0.0005, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3),
                                         registry=r)
        self.grammar_requests = Counter("mixbit_grammar_requests", "Requests decoded under a grammar",
                                        ["cache"], registry=r)
        self.tool_calls = Counter(
            "mixbit_tool_call_outcomes",
            "Tool-call outcomes: parsed, parse_failed, markup_in_content, forced_without_call "
            "(the last two should stay zero)", ["outcome", "variant"], registry=r)
        self.constrained_invalid = Counter(
            "mixbit_constrained_output_invalid", "Constrained outputs that did not validate "
            "(should stay zero)", ["kind", "variant"], registry=r)
        self.variant = Info("mixbit_variant", "A served variant and its provenance", ["variant"],
                            registry=r)
        # fidelity spot checks
        self.fid_checks = Counter("mixbit_fidelity_checks", "Finished spot checks",
                                  ["variant", "kind"], registry=r)
        self.fid_tokens = Counter("mixbit_fidelity_tokens", "Generated tokens re-scored by the reference",
                                  ["variant", "kind"], registry=r)
        self.fid_flips = Counter("mixbit_fidelity_flips",
                                 "Served tokens that were not the reference's top-1",
                                 ["variant", "kind"], registry=r)
        self.fid_kld = Histogram("mixbit_fidelity_kld", "Mean KL(reference || served) per check, nats/token",
                                 ["variant", "kind"], buckets=KLD, registry=r)
        self.fid_top1 = Histogram("mixbit_fidelity_top1_agreement",
                                  "Share of positions where served and reference top-1 agree, per check",
                                  ["variant", "kind"], buckets=RATIO, registry=r)
        self.fid_first = Histogram("mixbit_fidelity_first_divergence_position",
                                   "First generated position whose top-1 differs (checks that diverge)",
                                   ["variant", "kind"], buckets=POSITION, registry=r)
        self.fid_dropped = Counter("mixbit_fidelity_dropped", "Spot checks not run, by reason",
                                   ["reason", "variant"], registry=r)
        self.mirror = Counter("mixbit_mirror_comparisons", "Requests re-run on a second variant "
                              "(fidelity.mirror_rate) by how the two outputs compare: same_call, "
                              "different_arguments, different_function, call_vs_no_call, same_text, "
                              "different_text, json_valid_different, mirror_json_invalid; dropped_busy, "
                              "mirror_error", ["variant", "mirror", "outcome"], registry=r)
        self.fid_seconds = Histogram("mixbit_fidelity_check_seconds",
                                     "Compute time of one spot check (rests while serving excluded)",
                                     buckets=LATENCY, registry=r)
        r.register(_EngineCollector(state))

    def set_variant(self, variant: str, provenance: dict) -> None:
        info = {}
        for k in ("recipe", "bits_per_weight", "bytes", "measured_kld", "measured_top1",
                  "target_bpw", "source", "model_type"):
            v = provenance.get(k)
            if v is not None:
                info[k] = str(round(v, 6) if isinstance(v, float) else v)
        cal = provenance.get("calibration")
        if isinstance(cal, dict) and cal.get("sha256"):
            info["calibration_sha256"] = str(cal["sha256"])[:16]
        if provenance.get("path"):
            info["variant_key"] = os.path.basename(str(provenance["path"]).rstrip("/"))
        self.variant.labels(variant).info(info)

    def render(self) -> bytes:
        return generate_latest(self.registry)
