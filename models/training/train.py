"""`mixbit train-tiny`: trains the embedded Qwen3.5-architecture model on the generated corpus.

PyTorch + transformers' `Qwen3_5ForCausalLM` (its GatedDeltaNet fallback is chunked, which made it
6-7x faster than MLX on this CPU), one thread, a fixed seed. Every step draws its own documents
from a step-seeded generator, so a run is deterministic and resumes from its last checkpoint
without storing a corpus. The result is written in the published Qwen3.5 layout (see export.py).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import corpus


@dataclass
class TrainConfig:
    out: str = str(Path(__file__).parents[1] / "tiny-qwen3.5")
    work_dir: str = ".cache/train-tiny"
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    full_attention_interval: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    rope_theta: float = 10000.0
    # Tied input/output embeddings, as Qwen3.5's small checkpoints (0.8B-4B) have: copying a token
    # from the prompt then needs no separately learned output row per token.
    tie_word_embeddings: bool = True
    seq_len: int = 1024
    batch_rows: int = 4
    steps: int = 2200
    lr: float = 2e-3
    warmup_steps: int = 60
    cooldown_frac: float = 0.25  # constant LR while copying emerges, linear decay at the end
    warmup_mix_frac: float = 0.2  # copy-heavy curriculum for the first steps
    mix: str = "catalogue"  # corpus.MIXES: "catalogue" (the shipped model), "toolspace" (issue 15)
    # staged curriculum: the first `pre_mix_steps` draw from corpus.MIXES[pre_mix] (its warm-up
    # mix first), so a skill that emerges on one mix (copying arguments, on "catalogue") is there
    # before the harder mix starts
    pre_mix: str = ""
    pre_mix_steps: int = 0
    # the last `long_steps` pack rows of `long_seq_len` tokens (the same tokens per step, fewer
    # rows), so long agent loops are seen whole and positions past `seq_len` are trained
    long_seq_len: int = 2048
    long_steps: int = 0
    # the corpus.MIXES entry the tokenizer is trained on ("": `mix`); with a staged curriculum,
    # "catalogue" tokenizes the pre-phase's documents as the shipped model's tokenizer does
    tokenizer_mix: str = ""
    # a second stage: start from the weights and tokenizer of a model folder this command wrote
    # (the same shape), e.g. the shipped model, then train on `mix`; no tokenizer is trained
    init_from: str = ""
    # the generated tool space's training-only names (toolspace.py): the share of parameters
    # under composed names and of requested functions whose object is a made-up word
    rename_param: float = 0.5
    made_up_object: float = 0.25
    # copy-first phase: short rows of copy drills and short chats before anything else
    copy_phase_steps: int = 0
    copy_phase_seq_len: int = 256
    copy_phase_batch_rows: int = 8
    weight_decay: float = 0.1
    threads: int = 1
    # "fp32"; "bf16": bfloat16 autocast (master weights and AdamW stay float32), faster where the
    # CPU multiplies bfloat16 natively (AVX-512 BF16/AMX); opt-in: a 1,800-step toolspace pilot
    # with it never learned to copy arguments, cause not isolated (issue 15's notes);
    # "auto": bf16 where the CPU has it, else fp32
    precision: str = "fp32"
    # torch.compile: fuses transformers' GatedDeltaNet fallback (1,092 -> 1,852 tok/s measured with
    # `train-tiny --throughput 4`, with and without --train compile=false)
    compile: bool = True
    checkpoint_every: int = 100
    tokenizer_docs: int = 20000


def text_config(cfg: TrainConfig, eos_id: int, pad_id: int) -> dict:
    """The `text_config` block exactly as published Qwen3.5 checkpoints carry it."""
    layer_types = ["linear_attention" if (i + 1) % cfg.full_attention_interval else "full_attention"
                   for i in range(cfg.num_hidden_layers)]
    rotary = int(cfg.head_dim * 0.25) // 2
    return {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
        "full_attention_interval": cfg.full_attention_interval,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 0,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": [rotary - 2 * (rotary // 3), rotary // 3, rotary // 3],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }


def render(tokenizer, doc: dict) -> str:
    return tokenizer.apply_chat_template(doc["messages"], tools=doc["tools"], tokenize=False,
                                         enable_thinking=doc["enable_thinking"])


ASSISTANT_OPEN = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of what the assistant writes (its turn end token included)."""
    spans, pos = [], 0
    while (start := text.find(ASSISTANT_OPEN, pos)) != -1:
        start += len(ASSISTANT_OPEN)
        end = text.find(TURN_END, start)
        end = len(text) if end == -1 else end + len(TURN_END)
        spans.append((start, end))
        pos = end
    return spans


def encode_with_targets(fast_tokenizer, text: str) -> tuple[list[int], list[float]]:
    """Token ids and a per-token loss weight: 1 for assistant tokens, 0 for the prompt."""
    enc = fast_tokenizer.encode(text, add_special_tokens=False)
    spans = assistant_spans(text)
    weights, j = [], 0
    for start, _end in enc.offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        weights.append(1.0 if j < len(spans) and spans[j][0] <= start < spans[j][1] else 0.0)
    return enc.ids, weights


def step_batch(cfg: TrainConfig, step: int, tokenizer, fast) -> tuple[list[list[int]], list[list[float]]]:
    """Packed rows for one optimizer step, drawn from a generator seeded by (seed, step)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    mix, width, n_rows = phase(cfg, step)
    corpus.T.RENAME_PARAM, corpus.T.MADE_UP_OBJECT = cfg.rename_param, cfg.made_up_object
    eot = fast.token_to_id("<|endoftext|>")

    def draw() -> tuple[list[int], list[float]]:
        while True:  # the rare document longer than a row is skipped, never cut
            doc_ids, doc_w = encode_with_targets(fast, render(tokenizer, corpus.document(rng, mix)))
            if len(doc_ids) < width:
                return doc_ids + [eot], doc_w + [0.0]

    # Whole documents only: a tool call cut off from the tools and question that explain it
    # would teach the model to invent arguments. Each row opens with a document drawn from the
    # full mix, then is topped up with documents that fit; the rest is padding without loss.
    rows, row_w = [], []
    for _ in range(n_rows):
        ids, weights = draw()
        for _attempt in range(12):
            if width - len(ids) < 24:
                break
            more_ids, more_w = draw()
            if len(ids) + len(more_ids) <= width:
                ids, weights = ids + more_ids, weights + more_w
        pad = width - len(ids)
        rows.append(ids + [eot] * pad)
        row_w.append(weights + [0.0] * pad)
    return rows, row_w


def phase(cfg: TrainConfig, step: int) -> tuple[dict[str, float], int, int]:
    """(document mix, row width in tokens + 1, rows) of one step's batch."""
    if step < cfg.copy_phase_steps:
        return corpus.COPY_PHASE_MIX, cfg.copy_phase_seq_len + 1, cfg.copy_phase_batch_rows
    main_mix, warmup_mix = mixes(cfg, cfg.pre_mix if step < cfg.pre_mix_steps else cfg.mix)
    mix = warmup_mix if step < cfg.warmup_mix_frac * cfg.steps else main_mix
    if step >= cfg.steps - cfg.long_steps:
        return mix, cfg.long_seq_len + 1, max(1, cfg.batch_rows * cfg.seq_len // cfg.long_seq_len)
    return mix, cfg.seq_len + 1, cfg.batch_rows


def mixes(cfg: TrainConfig, name: str | None = None) -> tuple[dict[str, float], dict[str, float]]:
    name = cfg.mix if name is None else name
    if name not in corpus.MIXES:
        raise SystemExit(f"mix {name!r}: one of {', '.join(corpus.MIXES)}")
    return corpus.MIXES[name]


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_start = int(cfg.steps * (1 - cfg.cooldown_frac))
    if step < decay_start:
        return cfg.lr
    frac = (step - decay_start) / max(1, cfg.steps - decay_start)
    return cfg.lr * (1 - 0.9 * frac)


def ensure_tokenizer(cfg: TrainConfig, work: Path):
    from transformers import AutoTokenizer

    from .tokenizer import build_tokenizer, write_tokenizer_files

    tok_dir = work / "tokenizer"
    if cfg.init_from and not (tok_dir / "tokenizer.json").exists():
        tmp = tok_dir.with_suffix(".tmp")
        AutoTokenizer.from_pretrained(cfg.init_from).save_pretrained(str(tmp))
        tmp.rename(tok_dir)
    if not (tok_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        rng = random.Random(cfg.seed + 77)
        mix = mixes(cfg, cfg.tokenizer_mix or cfg.mix)[0]
        docs = [corpus.document(rng, mix) for _ in range(cfg.tokenizer_docs)]
        template = (Path(__file__).parents[1] / "chat" / "chat_template.jinja").read_text()
        # render with a throwaway byte-level tokenizer: the template needs a tokenizer object
        from tokenizers import Tokenizer, models as tk_models, pre_tokenizers

        scratch = Tokenizer(tk_models.BPE())
        scratch.pre_tokenizer = pre_tokenizers.ByteLevel()
        renderer = PreTrainedTokenizerFast(tokenizer_object=scratch, chat_template=template)
        texts = [render(renderer, d) for d in docs]
        tmp = tok_dir.with_suffix(".tmp")
        write_tokenizer_files(build_tokenizer(texts, cfg.vocab_size), tmp)
        tmp.rename(tok_dir)
    return AutoTokenizer.from_pretrained(str(tok_dir))


def build_model(cfg: TrainConfig, tokenizer):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tc = text_config(cfg, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                     tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    kwargs = {k: v for k, v in tc.items() if k not in ("architectures", "dtype", "model_type")}
    config = Qwen3_5TextConfig(**kwargs)
    torch.manual_seed(cfg.seed)
    return Qwen3_5ForCausalLM(config).float(), tc


def load_published(model, text_config: dict, folder: Path) -> None:
    """Loads a folder written by export_checkpoint into the training module, in float32."""
    from safetensors.torch import load_file

    theirs = json.loads((folder / "config.json").read_text())["text_config"]
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
             "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
             "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "tie_word_embeddings")
    differ = [k for k in shape if theirs.get(k) != text_config.get(k)]
    if differ:
        raise SystemExit(f"init_from {folder}: another shape ({', '.join(differ)} differ)")
    prefix = "model.language_model."
    state = {("model." + k[len(prefix):] if k.startswith(prefix) else k): v.float()
             for k, v in load_file(str(folder / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if text_config.get("tie_word_embeddings") else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"init_from {folder}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def use_bf16(cfg: TrainConfig) -> bool:
    if cfg.precision not in ("auto", "bf16", "fp32"):
        raise SystemExit(f"precision {cfg.precision!r}: auto, bf16 or fp32")
    return cfg.precision == "bf16" or (cfg.precision == "auto" and _cpu_has_bf16())


def forward_loss(cfg: TrainConfig, model):
    """The training step's forward: compiled and under bfloat16 autocast as `cfg` says.
    Returns f(x) -> logits; the module itself (its parameters, its state dict) is unchanged."""
    import contextlib

    import torch

    # static shapes: a staged run changes the row width once (long_steps), and compiling that
    # second shape as a dynamic one failed in Inductor (torch 2.13: "cannot determine truth value
    # of Relational: 1 < s27"); each shape compiles on its own instead
    fwd = torch.compile(model, dynamic=False) if cfg.compile else model
    bf16 = use_bf16(cfg)

    def run(x):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            return fwd(input_ids=x).logits.float()
    return run


def train(cfg: TrainConfig, max_minutes: float | None = None, log=print) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tokenizer(cfg, work)
    fast = tokenizer.backend_tokenizer
    model, tc = build_model(cfg, tokenizer)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = work / "checkpoint.pt"
    step, history, spent = 0, [], 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] != asdict(cfg):
            raise SystemExit(f"{ckpt} was made with other settings; remove {work} to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, history, spent = state["step"], state["history"], state.get("seconds", 0.0)
        log(f"resuming at step {step}")
    elif cfg.init_from:
        load_published(model, tc, Path(cfg.init_from))
        log(f"starting from the weights of {cfg.init_from}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, {cfg.steps} steps of "
        f"{cfg.batch_rows}x{cfg.seq_len} tokens, {'bfloat16 autocast' if use_bf16(cfg) else 'float32'}"
        f"{', compiled (the first step compiles: minutes)' if cfg.compile else ''}")
    forward = forward_loss(cfg, model)

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                    "step": step, "history": history,
                    "seconds": spent + time.time() - started}, tmp)
        os.replace(tmp, ckpt)

    started = time.time()
    bar = tqdm(total=cfg.steps, initial=step, desc="train-tiny", dynamic_ncols=True)
    model.train()
    while step < cfg.steps:
        rows, weights = step_batch(cfg, step, tokenizer, fast)
        x = torch.tensor(rows)
        w = torch.tensor(weights)[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        logits = forward(x[:, :-1])
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        loss = (nll * w.reshape(-1)).sum() / w.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        history.append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{sum(history[-20:]) / len(history[-20:]):.3f}", lr=f"{lr_at(cfg, step):.1e}")
        bar.update(1)
        if step % cfg.checkpoint_every == 0:
            save()
        if max_minutes is not None and time.time() - started > max_minutes * 60:
            log(f"stopping after {max_minutes} minutes at step {step}; run again to resume")
            save()
            bar.close()
            return work
    bar.close()
    save()
    tokens = step * cfg.batch_rows * cfg.seq_len
    seconds = spent + time.time() - started
    log(f"trained {step} steps, {tokens / 1e6:.1f}M tokens in {seconds / 60:.1f} min, final loss "
        f"{sum(history[-50:]) / max(1, len(history[-50:])):.3f}")
    from .export import export_checkpoint

    out = export_checkpoint(model, tc, tokenizer, Path(cfg.out), _train_info(asdict(cfg), step, history, seconds))
    log(f"wrote {out}")
    return out


def _train_info(config: dict, step: int, history: list[float], seconds: float | None = None) -> dict:
    return {"config": config, "steps": step, "loss_history_every_50": history[::50],
            **({"train_minutes": round(seconds / 60, 1)} if seconds is not None else {}),
            "final_loss": sum(history[-50:]) / max(1, len(history[-50:]))}


def throughput(cfg: TrainConfig, steps: int = 5) -> float:
    """Tokens per second of training steps at this config (for choosing a model size)."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)
    work = Path(cfg.work_dir)
    tokenizer = ensure_tokenizer(cfg, work)
    model, _ = build_model(cfg, tokenizer)
    forward = forward_loss(cfg, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows, _ = step_batch(cfg, 0, tokenizer, tokenizer.backend_tokenizer)
    x = torch.tensor(rows)
    forward(x[:, :-1]).sum().backward()  # compiles (when asked) before timing
    times = []
    for _ in range(steps):
        t = time.time()
        logits = forward(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.time() - t)
    best = sorted(times)[len(times) // 2]
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params_M": round(n / 1e6, 2), "rows": f"{cfg.batch_rows}x{cfg.seq_len}",
                      "precision": "bf16" if use_bf16(cfg) else "fp32", "compiled": cfg.compile,
                      "threads": cfg.threads, "s_per_step": round(best, 3),
                      "tok_per_s": round(cfg.batch_rows * cfg.seq_len / best)}))
    return cfg.batch_rows * cfg.seq_len / best


def export_from_checkpoint(cfg: TrainConfig, out: Path | None = None) -> Path:
    """Writes the latest checkpoint of a (possibly unfinished) run as a Qwen3.5 folder."""
    import torch

    from .export import export_checkpoint

    work = Path(cfg.work_dir)
    ckpt = work / "checkpoint.pt"
    if not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint in {work}; train first")
    tokenizer = ensure_tokenizer(cfg, work)
    state = torch.load(ckpt, weights_only=False)
    saved = TrainConfig(**state["config"])
    model, tc = build_model(saved, tokenizer)
    model.load_state_dict(state["model"])
    return export_checkpoint(model, tc, tokenizer, Path(out or saved.out),
                             _train_info(state["config"], state["step"], state["history"], state.get("seconds")))
