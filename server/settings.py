"""Settings: config.toml < environment (MIXBIT_<SECTION>_<KEY>) < CLI flags, validated once.

Every key lives in a section of config.toml (`[model] source = ...`). The environment variable
for a key is MIXBIT_ + section + _ + key in capitals (MIXBIT_SERVER_PORT=8001); other MIXBIT_*
variables (Kubernetes service links, Docker links) are ignored and logged once. The CLI takes the
common keys as flags (--port 8001) and any key as --set section.key=value. A wrong key or value
stops start-up with one message that names the key and what it accepts.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Section):
    source: str = Field("embedded:tiny-qwen3.5", description="embedded:<name>, a local folder "
                        "in Hugging Face layout, or a hub repo id such as Qwen/Qwen3.5-2B")
    revision: str = Field("main", description="hub revision (branch, tag or commit)")
    cache_dir: str = Field("~/.cache/mixbit", description="quantized variants")
    hub_cache_dir: str = Field("", description="hub downloads; empty: Hugging Face's default cache")
    allow_download: bool = Field(True, description="fetch hub ids that are not cached yet")
    served_name: str = Field("", description="model id clients use; default: derived from source")


RECIPE_NAMES = ("bf16", "uniform-4", "uniform-3", "unsloth-static", "mixbit-auto")


class QuantSettings(_Section):
    recipe: Literal["bf16", "uniform-4", "uniform-3", "unsloth-static", "mixbit-auto"] = Field(
        "mixbit-auto", description="mixbit-auto (default) and the others quantize at first start "
        "and cache the result (see quant/README.md); bf16 serves the checkpoint unquantized")
    target_bpw: float = Field(4.5, ge=2.5, le=16.0, description="mixbit-auto's budget in bits per weight")
    calibration: str = Field("", description="JSONL file of extra calibration chats; \"self\": the "
                             "model's own completions of the built-in prompts; empty: built-in")
    sensitivity: Literal["auto", "ablation", "probe", "fisher"] = Field(
        "auto", description="mixbit-auto's sensitivity measure: ablation (every tensor quantized "
        "alone at every bit width, exact KLD), probe (exact at 4 bits for as many tensors as "
        "sensitivity_seconds allows, activation-weighted errors for the rest; forward-only, one "
        "layer in memory), fisher (diagonal Fisher; whole model and gradients in memory), auto: "
        "ablation when it fits sensitivity_seconds, else probe")
    sensitivity_seconds: float = Field(120.0, gt=0, description="time budget of the sensitivity "
                                       "measurement at a first start (auto and probe)")
    memory_gb: float = Field(0.0, ge=0, description="memory a first start may use, in GB; 0: what "
                             "the machine (or the container's cgroup) has available. The plan is "
                             "logged and shown on /ready before any work; a plan over it is refused")
    variants: list[str] = Field(default_factory=list, description="serve several variants side by "
                                "side, e.g. [\"mixbit-auto\", \"uniform-4\", \"bf16\"] (a recipe, "
                                "or mixbit-auto@BPW), each as <name>:<variant>, the bare <name> being "
                                "the first; empty: the one `recipe`")

    @field_validator("variants")
    @classmethod
    def _variants(cls, value: list[str]) -> list[str]:
        out = []
        for item in value:
            label = item.strip()
            recipe, _, bpw = label.partition("@")
            if recipe not in RECIPE_NAMES:
                raise ValueError(f"{label!r} is not a recipe ({', '.join(RECIPE_NAMES)}, or "
                                 "mixbit-auto@BPW)")
            if bpw:
                try:
                    ok = recipe == "mixbit-auto" and 2.5 <= float(bpw) <= 16.0
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"{label!r}: only mixbit-auto takes @BPW, from 2.5 to 16")
            if label in out:
                raise ValueError(f"{label!r} is listed twice")
            out.append(label)
        return out

    def labels(self) -> list[str]:
        """The variants to serve: `variants`, or the one `recipe` (mixbit-auto at target_bpw)."""
        return list(self.variants) or [self.recipe]

    def spec(self, label: str) -> tuple[str, float | None]:
        """(recipe, target bits per weight or None) of a variant label."""
        recipe, _, bpw = label.partition("@")
        if recipe != "mixbit-auto":
            return recipe, None
        return recipe, float(bpw) if bpw else self.target_bpw


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="empty: no auth")
    cors_origins: list[str] = Field(default_factory=list, description="empty: CORS off")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_prompt_tokens: int = Field(0, ge=0, description="0: the model's context length")
    max_concurrent_sequences: int = Field(16, ge=1, le=1024)
    max_queue: int = Field(64, ge=0)
    prefill_tokens: int = Field(512, ge=16, description="prompt tokens per prefill round, across "
                                "the prompts prefilled together; running streams decode a step "
                                "between rounds")
    prefix_cache_entries: int = Field(64, ge=0, description="prompt caches kept for prefix reuse")
    prefix_cache_bytes: int = Field(1 << 30, ge=0, description="memory bound of the prefix cache")
    memory_budget_bytes: int = Field(0, ge=0, description="what the served variants' weights (and "
                                     "an in-process bf16 reference) may hold together; start-up "
                                     "refuses variants that do not fit; 0: no limit")
    request_timeout_s: float = Field(600.0, gt=0)
    shutdown_grace_s: float = Field(10.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_auth: bool = Field(False, description="require the API key on /metrics too")
    distributed: bool = Field(False, description="one model over the ranks of `mlx.launch`: rank "
                              "0 serves HTTP, the others hold their tensor-parallel shard")


class GenerationSettings(_Section):
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, the checkpoint's dtype on GPU")
    cpu_quantized: Literal["auto", "dense", "packed", "mlx"] = Field(
        "auto", description="how quantized (and bf16) projections run on CPU: packed (mixbit's "
        "kernels on the packed weights), dense (float32, dequantized once at load), mlx (MLX's "
        "quantized_matmul, prompts through a transient dequantized weight), auto: per layer shape, "
        "packed unless dense float32 measured faster and fits a quarter of physical memory, as "
        "measured at the variant's first start on this machine (kept under "
        "model.cache_dir/cpu-plans)")
    cpu_activations: Literal["auto", "float32", "int16", "int8"] = Field(
        "auto", description="how activations enter the packed CPU kernels: float32 (exact), int16 "
        "(16-bit integers per group of the weight, within 1/65024 of the group's largest value, "
        "where the CPU has AVX-512 VNNI: decode rows, and prompts and decode batches against "
        "column panels), int8 (as int16, and the engine's prefill on 8-bit integers per group, "
        "within 1/254 of the group's largest value: only the state a prompt leaves moves), auto: "
        "per layer shape, whichever measured faster at load")
    max_tokens: int = Field(512, ge=1, description="default when a request names none")
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    enable_thinking: bool = Field(False, description="default for chat_template_kwargs")
    seed: int = 0
    tool_grammar: bool = Field(True, description="under tool_choice auto, tool calls may only "
                               "name offered functions (strict ones follow their schema)")
    mtp: Union[bool, Literal["auto"]] = Field("auto", description="self-speculative decoding with the "
                                             "checkpoint's own MTP head (where it has one): the head drafts, "
                                             "the model verifies several tokens in one forward; outputs are the "
                                             "same as without it. \"auto\": where a drafting step measured "
                                             "faster per token at the expected acceptance, on this machine and "
                                             "variant (measured once, kept beside the CPU plan; "
                                             "docs/speculative.md)")
    mtp_drafts: int = Field(1, ge=1, le=8, description="tokens the MTP head drafts per step (while one "
                            "sequence decodes; a batch of several decodes plainly)")
    mtp_draft_vocab: int = Field(32768, ge=0, description="the MTP head drafts over this many of the most "
                                 "frequent tokens (its cost is mostly the output head's rows); 0: the whole "
                                 "vocabulary. Outputs do not depend on it")


class FidelitySettings(_Section):
    enabled: bool = True
    sample_rate: float = Field(0.1, ge=0.0, le=1.0, description="share of finished requests checked")
    max_per_minute: int = Field(60, ge=0)
    queue_size: int = Field(16, ge=1, description="checks waiting; beyond it they are dropped")
    reference: str = Field("auto", description="auto (the unquantized source, loaded lazily), a "
                           "model source, or the URL of a mixbit instance serving bf16")
    reference_api_key: str = ""
    reference_max_bytes: int = Field(0, ge=0, description="memory budget of an in-process "
                                     "reference; 0: no limit")
    top_k: int = Field(64, ge=1, le=1024, description="log-probs per position from a remote reference")
    max_tokens: int = Field(256, ge=1, description="generated tokens scored per check")
    busy_share: float = Field(0.02, ge=0.0, le=1.0, description="largest share of wall time the "
                              "checks may compute while requests are being served (idle time is "
                              "used fully); 0: only when idle")
    chunk_tokens: int = Field(128, ge=8, description="tokens per forward slice of a check; the "
                              "worker can yield to serving between slices")
    keep: int = Field(200, ge=1, description="recent checks shown by /v1/fidelity")
    mirror_rate: float = Field(0.0, ge=0.0, le=1.0, description="with several variants served: "
                               "share of finished chat requests re-run on a second variant off the "
                               "client's path and compared (tool called or not, same function, same "
                               "arguments, JSON valid); the client never sees the second answer; 0: off")
    mirror_to: str = Field("", description="the variant mirrored to (a quant.variants entry); empty: "
                           "the next one in the list (the last one mirrors to the first)")


class Settings(_Section):
    model: ModelSettings = Field(default_factory=ModelSettings)
    quant: QuantSettings = Field(default_factory=QuantSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    fidelity: FidelitySettings = Field(default_factory=FidelitySettings)


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSettings, "quant": QuantSettings, "server": ServerSettings,
    "generation": GenerationSettings, "fidelity": FidelitySettings,
}
ENV_PREFIX = "MIXBIT_"


class SettingsError(ValueError):
    """A bad config key or value; the message names the key and what it accepts."""


def _known(section: str) -> str:
    return ", ".join(SECTIONS[section].model_fields)


def _coerce_env(section: str, key: str, raw: str) -> Any:
    annotation = SECTIONS[section].model_fields[key].annotation
    if annotation is not None and getattr(annotation, "__origin__", None) is list:
        raw = raw.strip()
        if raw.startswith("["):
            return json.loads(raw)
        return [item.strip() for item in raw.split(",") if item.strip()]
    return raw


# What platforms inject beside settings: kubelet's service links for a Service named "mixbit"
# (MIXBIT_SERVICE_HOST, MIXBIT_SERVICE_PORT_HTTP, MIXBIT_PORT=tcp://..., MIXBIT_PORT_8000_TCP_ADDR)
# and Docker's legacy links (MIXBIT_NAME, MIXBIT_ENV_*). For a Service named "mixbit-server" the
# same shapes land inside a known section (MIXBIT_SERVER_SERVICE_HOST, MIXBIT_SERVER_PORT=tcp://..).
_PLATFORM_SUFFIX = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)"
                              r"(_(ADDR|PORT|PROTO))?)$")
_SERVICE_URL = re.compile(r"^(tcp|udp|sctp)://[^\s]*:\d+$")


def _platform_injected(name: str, raw: str) -> bool:
    return bool(_PLATFORM_SUFFIX.search(name)) or bool(_SERVICE_URL.match(raw.strip()))


def env_overrides(environ: dict[str, str] | None = None,
                  ignored: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Settings from MIXBIT_<SECTION>_<KEY> variables. A variable whose section is unknown, or that
    has the shape of a Kubernetes/Docker service link, is not a setting: its name goes into
    `ignored` (start-up logs them once). An unknown key in a known section is an error."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, dict[str, Any]] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in ("MIXBIT_CONFIG",):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None or _platform_injected(name, raw):
            if ignored is not None:
                ignored.append(name)
            continue
        key = rest[len(section) + 1:]
        if key not in SECTIONS[section].model_fields:
            raise SettingsError(f"environment variable {name}: unknown key '{section}.{key}'; "
                                f"known keys in [{section}]: {_known(section)}")
        out.setdefault(section, {})[key] = _coerce_env(section, key, raw)
    return out


def parse_assignment(text: str) -> tuple[str, str, Any]:
    """'server.port=8001' -> ('server', 'port', 8001); values parse as TOML when they can."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise SettingsError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. server.port=8001")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if not isinstance(values, dict):
            out[section] = values
            continue
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            out[section] = {}
        out[section].update(values)
    return out


def _explain(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        loc = [str(p) for p in e["loc"]]
        where = ".".join(loc)
        if e["type"] == "extra_forbidden":
            if len(loc) == 1:
                lines.append(f"unknown section [{where}]; known sections: {', '.join(SECTIONS)}")
            else:
                lines.append(f"unknown key '{where}'; known keys in [{loc[0]}]: {_known(loc[0])}")
            continue
        allowed = ""
        if e["type"] == "literal_error":
            allowed = f" (allowed: {e['ctx']['expected']})"
        lines.append(f"{where}: {e['msg']}{allowed}; got {e.get('input')!r}")
    return "invalid settings: " + "; ".join(lines)


def load_settings(config_path: str | Path | None = None, cli: dict[str, dict[str, Any]] | None = None,
                  environ: dict[str, str] | None = None, ignored: list[str] | None = None) -> Settings:
    """Builds the settings from the three layers; raises SettingsError naming the bad key.
    `ignored` collects the MIXBIT_* variables that are not settings (see env_overrides)."""
    data: dict[str, Any] = {}
    environ = dict(os.environ if environ is None else environ)
    path = config_path or environ.get("MIXBIT_CONFIG")
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise SettingsError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {p} is not valid TOML: {exc}") from None
    data = _merge(data, env_overrides(environ, ignored))
    data = _merge(data, cli or {})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(_explain(exc)) from None


def default_config_path() -> Path | None:
    """./config.toml when it exists (the repository's own, documented key by key)."""
    p = Path("config.toml")
    return p if p.is_file() else None
