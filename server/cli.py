"""The `mixbit` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .settings import SECTIONS, SettingsError, default_config_path, load_settings, parse_assignment

# CLI flags that mirror config keys: flag -> (section, key)
MIRRORED = {
    "model": ("model", "source"), "revision": ("model", "revision"),
    "recipe": ("quant", "recipe"), "host": ("server", "host"), "port": ("server", "port"),
    "dtype": ("generation", "compute_dtype"), "seed": ("generation", "seed"),
    "target_bpw": ("quant", "target_bpw"), "calibration": ("quant", "calibration"),
    "variants": ("quant", "variants"),
}


def _add_settings_flags(p: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    p.add_argument("--config", help="config.toml to read (default: ./config.toml if present)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set server.port=8001")
    for flag in flags:
        section, key = MIRRORED[flag]
        field = SECTIONS[section].model_fields[key]
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, default=None,
                       help=f"{section}.{key}: {field.description or ''}")


IGNORED_ENV: list[str] = []  # MIXBIT_* variables that are not settings (service links, ...)


def _settings(args: argparse.Namespace, flags: tuple[str, ...]):
    cli: dict[str, dict[str, Any]] = {}
    for text in args.set:
        section, key, value = parse_assignment(text)
        cli.setdefault(section, {})[key] = value
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None:
            section, key = MIRRORED[flag]
            if getattr(SECTIONS[section].model_fields[key].annotation, "__origin__", None) is list:
                value = [item.strip() for item in value.split(",") if item.strip()]  # a,b,c
            cli.setdefault(section, {})[key] = value
    IGNORED_ENV.clear()
    return load_settings(args.config or default_config_path(), cli, ignored=IGNORED_ENV)


def _log_start(logger) -> None:
    """What start-up owes the log once: the BLAS under MLX, and environment that was ignored."""
    from mixbit.models.blas import report

    report(logger)
    if IGNORED_ENV:
        logger.info("ignored %d MIXBIT_* environment variables that are not settings (Kubernetes "
                    "or Docker service links): %s", len(IGNORED_ENV), ", ".join(IGNORED_ENV))


def _load(settings):
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    m = settings.model
    resolved = resolve(m.source, m.revision, m.hub_cache_dir or None, m.allow_download)
    return load(resolved, settings.generation.compute_dtype)


def _sampler(settings, temperature: float | None, top_p: float | None):
    from mlx_lm.sample_utils import make_sampler

    t = settings.generation.temperature if temperature is None else temperature
    p = settings.generation.top_p if top_p is None else top_p
    return make_sampler(temp=t, top_p=p)


GEN_FLAGS = ("model", "revision", "dtype", "seed")


def cmd_generate(args) -> int:
    import mlx.core as mx
    from mlx_lm import generate

    settings = _settings(args, GEN_FLAGS)
    lm = _load(settings)
    mx.random.seed(settings.generation.seed)
    text = generate(lm.model, lm.tokenizer, args.prompt, max_tokens=args.max_tokens,
                    sampler=_sampler(settings, args.temperature, args.top_p))
    print(text)
    return 0


def cmd_chat(args) -> int:
    import mlx.core as mx
    from mlx_lm import generate

    from mixbit.models.chat.template import prompt_opens_think, render_chat
    from mixbit.models.chat.toolcall import parse_output, parser_for_template

    settings = _settings(args, GEN_FLAGS)
    tools = None
    if args.tools:
        try:
            tools = json.loads(Path(args.tools).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SettingsError(f"--tools {args.tools}: cannot read a JSON list of tools ({exc})") from None
        if isinstance(tools, dict):
            tools = [tools]
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.message})
    lm = _load(settings)
    think = settings.generation.enable_thinking if args.think is None else args.think
    prompt = render_chat(lm.tokenizer, messages, tools, enable_thinking=think)
    mx.random.seed(settings.generation.seed)
    text = generate(lm.model, lm.tokenizer, prompt, max_tokens=args.max_tokens,
                    sampler=_sampler(settings, args.temperature, args.top_p))
    parsed = parse_output(text, parser_for_template(lm.chat_template), tools, prompt_opens_think(prompt))
    if args.json:
        print(json.dumps({"reasoning": parsed.reasoning, "content": parsed.content,
                          "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                         for c in parsed.tool_calls],
                          "errors": parsed.errors}, indent=2))
        return 0
    if parsed.reasoning:
        print(f"[reasoning] {parsed.reasoning}")
    for call in parsed.tool_calls:
        print(f"[tool call] {call.name}({json.dumps(call.arguments)})")
    for err in parsed.errors:
        print(f"[malformed] {err}")
    if parsed.content:
        print(parsed.content)
    return 0


def _overrides(cfg, texts: list[str]):
    """A training dataclass with `--train KEY=VALUE` overrides, each parsed as the field's type."""
    for text in texts:
        key, _, value = text.partition("=")
        if key not in cfg.__dataclass_fields__:
            raise SettingsError(f"--train {key}: unknown; known: {', '.join(cfg.__dataclass_fields__)}")
        current = getattr(cfg, key)
        if isinstance(current, bool):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise SettingsError(f"--train {key}={value}: true or false")
            setattr(cfg, key, value.lower() in ("true", "1", "yes", "on"))
            continue
        try:
            setattr(cfg, key, type(current)(value))
        except ValueError:
            raise SettingsError(f"--train {key}={value}: not a {type(current).__name__}") from None
    return cfg


def cmd_train_tiny(args) -> int:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise SettingsError("train-tiny needs PyTorch: pip install 'mixbit[train]'")
    from mixbit.models.training.train import TrainConfig, export_from_checkpoint, train
    cfg = _overrides(TrainConfig(), args.set_train)
    if args.out:
        cfg.out = args.out
    if args.work_dir:
        cfg.work_dir = args.work_dir
    if args.export_only:
        print(f"wrote {export_from_checkpoint(cfg, Path(args.out) if args.out else None)}")
        return 0
    if args.throughput:
        from mixbit.models.training.train import throughput

        throughput(cfg, steps=args.throughput)
        return 0
    train(cfg, max_minutes=args.max_minutes)
    return 0


def cmd_train_mtp(args) -> int:
    from mixbit.models.training.mtp import MtpConfig, train_mtp

    cfg = _overrides(MtpConfig(), args.set_train)
    if args.model:
        cfg.model = args.model
    info = train_mtp(cfg)
    print(json.dumps({k: info[k] for k in ("heldout_agreement", "heldout_kl", "seconds")}))
    return 0


def cmd_eval(args) -> int:
    from mixbit.quant.report import run_model_eval

    settings = _settings(args, GEN_FLAGS)
    if args.variants:
        from mixbit.quant.compare import main_eval

        specs = [v.strip() for v in args.variants.split(",") if v.strip()]
        print(main_eval(settings.model.source, specs, settings.model.cache_dir, args.out, args.plot,
                        n_tool=args.n_tool, soak=args.soak, n_docs=args.n_docs or 120))
        for f in (args.out, args.plot):
            if f:
                print(f"wrote {f}")
        return 0
    lm = _load(settings)
    report = run_model_eval(lm, n_tool=args.n_tool, n_plain=args.n_plain, n_docs=args.n_docs or 300,
                            thinking=args.think, soak_rounds=args.soak or 30)
    print(report["table"])
    if args.out:
        Path(args.out).write_text(json.dumps({k: v for k, v in report.items() if k != "table"},
                                             indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


SERVE_FLAGS = ("model", "revision", "recipe", "variants", "target_bpw", "calibration", "host", "port",
               "dtype")
QUANT_FLAGS = ("model", "revision", "recipe", "target_bpw", "calibration")


def cmd_quantize(args) -> int:
    import logging

    from tqdm import tqdm

    from mixbit.models.registry import resolve
    from mixbit.quant.progress import Progress
    from mixbit.quant.variants import ensure_variant, quantize

    settings = _settings(args, QUANT_FLAGS)
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    _log_start(logging.getLogger("mixbit.quantize"))
    m, q = settings.model, settings.quant
    if q.recipe == "bf16":
        raise SettingsError("--recipe bf16 does not quantize; pick uniform-4, uniform-3, "
                            "unsloth-static or mixbit-auto")
    resolved = resolve(m.source, m.revision, m.hub_cache_dir or None, m.allow_download)
    bar = tqdm(desc=f"quantize {q.recipe}", bar_format="{desc}: {elapsed} {postfix}")
    progress = Progress(on_update=lambda snap: bar.set_postfix_str(snap.line()), log_every_s=1.0)

    bpw = q.target_bpw if q.recipe == "mixbit-auto" else None
    if args.out:
        out = Path(args.out)
        if out.exists():
            raise SettingsError(f"--out {out} exists; choose a new folder")
        manifest = quantize(resolved, q.recipe, out, target_bpw=bpw, calibration=q.calibration or None,
                            sensitivity=q.sensitivity, sensitivity_seconds=q.sensitivity_seconds,
                            progress=progress, cache_root=Path(m.cache_dir).expanduser(),
                            memory_gb=q.memory_gb)
        path = out
    else:
        variant = ensure_variant(resolved, q.recipe, m.cache_dir, progress, target_bpw=bpw,
                                 calibration=q.calibration or None, sensitivity=q.sensitivity,
                                 sensitivity_seconds=q.sensitivity_seconds, memory_gb=q.memory_gb)
        manifest, path = variant.manifest, variant.path
    bar.close()
    print(json.dumps({"path": str(path), "recipe": q.recipe,
                      "bits_per_weight": round(manifest.get("bits_per_weight", 16.0), 3),
                      "bytes": manifest.get("bytes"), "predicted_kld": manifest.get("predicted_kld")}))
    return 0


def cmd_export(args) -> int:
    """The model as GGUF for llama.cpp, and/or a variant's allocation as llama-quantize's
    --tensor-type-file (docs/llama-quality.md)."""
    import os
    import tempfile

    from mixbit.models.registry import resolve
    from mixbit.quant.gguf_export import GGUFExportError, tensor_types, write_gguf

    if not (args.gguf or args.tensor_types):
        raise SettingsError("nothing to export: give --gguf FILE and/or --tensor-types FILE")
    settings = _settings(args, QUANT_FLAGS)
    m, q = settings.model, settings.quant
    resolved = resolve(m.source, m.revision, m.hub_cache_dir or None, m.allow_download)
    done: dict[str, Any] = {"model": m.source}
    try:
        if args.gguf:
            out = write_gguf(resolved.path, args.gguf, mtp=not args.no_mtp)
            done["gguf"] = {"path": str(out), "bytes": out.stat().st_size}
        if args.tensor_types:
            from mixbit.quant.variants import ensure_variant

            if q.recipe == "bf16":
                raise SettingsError("--tensor-types needs a quantized recipe (mixbit-auto, uniform-4, ...); "
                                    "bf16 quantizes nothing")
            variant = ensure_variant(resolved, q.recipe, m.cache_dir, target_bpw=q.target_bpw
                                     if q.recipe == "mixbit-auto" else None,
                                     calibration=q.calibration or None, sensitivity=q.sensitivity,
                                     sensitivity_seconds=q.sensitivity_seconds, memory_gb=q.memory_gb)
            lines = tensor_types(variant.path, mtp=not args.no_mtp)
            target = Path(args.tensor_types)
            fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", prefix=".types-")
            with os.fdopen(fd, "w") as fh:
                fh.write("\n".join(lines) + "\n")
            os.replace(tmp, target)
            done["tensor_types"] = {"path": str(target), "tensors": len(lines), "recipe": q.recipe,
                                    "variant": str(variant.path)}
    except (GGUFExportError, OSError) as exc:
        raise SettingsError(str(exc)) from None
    print(json.dumps(done))
    return 0


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from .app import create_app

    if getattr(args, "distributed", False):
        args.set.append("server.distributed=true")
    settings = _settings(args, SERVE_FLAGS)
    level = settings.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log_start(logging.getLogger("mixbit.server"))
    if settings.server.distributed and len(settings.quant.labels()) > 1:
        raise SettingsError("quant.variants: distributed serving shards one variant over the ranks; "
                            "serve several variants from separate (or non-distributed) servers")
    group = None
    if settings.server.distributed:
        import mlx.core as mx

        from .app import follow

        group = mx.distributed.init()
        logging.getLogger("mixbit.server").info("distributed: rank %d of %d", group.rank(), group.size())
        if group.rank() > 0:
            return follow(settings, group)
    app = create_app(settings, group=group)
    uvicorn.run(app, host=settings.server.host, port=settings.server.port,
                log_level=settings.server.log_level, timeout_graceful_shutdown=int(
                    settings.server.shutdown_grace_s) + 1)
    return 0


def cmd_config(args) -> int:
    settings = _settings(args, tuple(MIRRORED))
    print(json.dumps(settings.model_dump(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixbit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="one-shot completion of raw text (no chat template)")
    p.add_argument("prompt")
    _add_settings_flags(p, GEN_FLAGS)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="one chat turn through the model's chat template, tools optional")
    p.add_argument("message")
    p.add_argument("--tools", help="JSON file with a list of OpenAI-style tools")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="enable_thinking for the template (default: generation.enable_thinking)")
    p.add_argument("--json", action="store_true", help="print the parsed message as JSON")
    _add_settings_flags(p, GEN_FLAGS)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("train-tiny", help="train the embedded tiny Qwen3.5 (needs mixbit[train])")
    p.add_argument("--out", help="checkpoint folder to write (default: models/tiny-qwen3.5)")
    p.add_argument("--work-dir", help="where the tokenizer and resumable checkpoints live")
    p.add_argument("--max-minutes", type=float, help="stop (resumably) after this long")
    p.add_argument("--train", dest="set_train", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TrainConfig field, e.g. --train steps=200")
    p.add_argument("--throughput", type=int, nargs="?", const=5, default=0, metavar="STEPS",
                   help="time STEPS training steps (default 5, after compiling) at these settings "
                   "and print tokens/s; trains nothing")
    p.add_argument("--export-only", action="store_true",
                   help="write the latest checkpoint of the run as a model folder, do not train")
    p.set_defaults(func=cmd_train_tiny)

    p = sub.add_parser("train-mtp", help="train an MTP head (speculative drafts) on top of a frozen model folder")
    p.add_argument("--model", help="model folder to add the head to (default: models/tiny-qwen3.5)")
    p.add_argument("--train", dest="set_train", action="append", default=[], metavar="KEY=VALUE",
                   help="override an MtpConfig field, e.g. --train steps=100")
    p.set_defaults(func=cmd_train_mtp)

    p = sub.add_parser("eval", help="held-out loss per data kind and tool-call accuracy")
    _add_settings_flags(p, GEN_FLAGS)
    p.add_argument("--n-tool", type=int, default=120, help="held-out prompts that need a tool")
    p.add_argument("--n-plain", type=int, default=60, help="held-out prompts that need none")
    p.add_argument("--n-docs", type=int, help="held-out documents for the loss (default 300; "
                   "120 per variant with --variants)")
    p.add_argument("--think", action="store_true", help="also evaluate with thinking on")
    p.add_argument("--out", help="write the numbers as JSON here")
    p.add_argument("--variants", help="compare quantized variants against bf16, e.g. "
                   "uniform-4,uniform-3,unsloth-static,mixbit-auto,mlx-uniform-4,mlx-dynamic@4.5")
    p.add_argument("--plot", help="with --variants: write a PNG of KLD against size here")
    p.add_argument("--soak", nargs="?", type=int, const=70, default=0, metavar="ROUNDS",
                   help="with --variants: also serve each variant with `mixbit serve` and run an agent "
                   "loop through its /v1/messages, with and without the tool grammar, until a round "
                   "leaks tool markup or calls no tool, ROUNDS rounds (default 70) or the context is full; "
                   "without --variants: the in-process soak's rounds (default 30)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("quantize", help="quantize a model with a recipe (cached, or into --out)")
    _add_settings_flags(p, QUANT_FLAGS)
    p.add_argument("--out", help="write the variant into this new folder instead of the cache")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export", help="the model as GGUF for llama.cpp; a variant's bits as llama-quantize tensor types")
    _add_settings_flags(p, QUANT_FLAGS)
    p.add_argument("--gguf", metavar="FILE", help="write the model (bf16, with its MTP head for llama-server's "
                   "--spec-type draft-mtp) as GGUF here")
    p.add_argument("--tensor-types", metavar="FILE",
                   help="write the variant's allocation (--recipe, --target-bpw) as llama-quantize's "
                        "--tensor-type-file here: each tensor at the ggml type nearest its bits")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the MTP head out (for a llama.cpp without Qwen3.5 MTP support)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_settings_flags(p, SERVE_FLAGS)
    p.add_argument("--distributed", action="store_true",
                   help="server.distributed: one model over the ranks of mlx.launch (rank 0 serves HTTP)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("config", help="print the effective settings")
    _add_settings_flags(p, tuple(MIRRORED))
    p.set_defaults(func=cmd_config)
    return parser


def kebab_case(argv: list[str]) -> list[str]:
    """Flags are kebab-case (--target-bpw); the underscore spelling (--target_bpw) is an alias."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def keep_torch_out() -> None:
    """Only `train-tiny` uses PyTorch, but transformers imports it whenever it is installed (to
    load a tokenizer, through its RoPE utilities): +160-270 MB resident and ~3 s of start-up in a
    serving process for nothing. A `None` in `sys.modules` is Python's own way to say a module
    is absent: `importlib.util.find_spec` answers None, so transformers runs tokenizer-only, as
    in the Docker image, which has no PyTorch. Left alone where torch is already imported."""
    sys.modules.setdefault("torch", None)


def main(argv: list[str] | None = None) -> int:
    from mixbit.models.blas import ensure_fast_blas

    ensure_fast_blas()  # before anything imports mlx.core
    from mixbit.models.registry import ModelSourceError

    args = build_parser().parse_args(kebab_case(sys.argv[1:] if argv is None else list(argv)))
    if args.command != "train-tiny":
        keep_torch_out()
    try:
        return args.func(args)
    except (SettingsError, ModelSourceError) as exc:
        print(f"mixbit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
