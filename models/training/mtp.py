"""`mixbit train-mtp`: trains a multi-token-prediction head on top of a frozen model folder.

Qwen3.5's MTP head (`mtp.*`) predicts the token after next: at position p it takes the
embedding of token x_p and the model's final (normed) hidden state of the previous position,
h_{p-1} (zeros before the first token), through `mtp.fc`, one full-attention decoder layer with
its own cache, `mtp.norm` and the model's own output head, and predicts x_{p+1} as the model
would after x_p. mixbit drafts with it (server/speculative.py), so what matters is how often its
first choice is the model's own: it is trained by distillation, cross-entropy against the frozen
model's distribution at the same position, on the assistant tokens of the corpus the model was
trained on (models/training/corpus.py), and the report is that agreement on held-out documents.

The model's own tensors are not touched: the head's tensors are added to the folder's
`model.safetensors` in the published layout (`mtp.fc.weight`, `mtp.layers.0.*`, zero-centred
norms, bfloat16) and `mtp_num_hidden_layers` set in its config. Runs on MLX (the base model's
hidden states are computed once per batch without gradients; only the head trains).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "mtp.norm.weight",
            ".q_norm.weight", ".k_norm.weight", ".pre_fc_norm_embedding.weight", ".pre_fc_norm_hidden.weight")


@dataclass
class MtpConfig:
    model: str = str(Path(__file__).parents[1] / "tiny-qwen3.5")
    steps: int = 400
    # rows as long as the model's own (1,024 tokens): a document longer than a row is skipped,
    # and with 512 nearly every tool-calling document was (the first head drafted tool calls at 4%)
    rows: int = 2
    seq_len: int = 1024
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 1  # the corpus draws of this run (the model was trained on seed 0's)
    mix: str = "catalogue"
    eval_rows: int = 16
    init_layer_from: str = "last-full"  # the MTP layer starts as a copy of the model's last full-attention layer


def _corpus(cfg: MtpConfig, folder: Path):
    from transformers import AutoTokenizer

    from .train import TrainConfig

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tc = TrainConfig(seed=cfg.seed, seq_len=cfg.seq_len, batch_rows=cfg.rows, mix=cfg.mix,
                     warmup_mix_frac=0.0, steps=10**9)
    return tc, tokenizer, tokenizer.backend_tokenizer


def _batch(tc, step: int, tokenizer, fast):
    import mlx.core as mx

    from .train import step_batch

    rows, weights = step_batch(tc, step, tokenizer, fast)
    return mx.array(rows), mx.array(weights)


def load_frozen(folder: Path):
    """The folder's model as mixbit serves it in float32 (dense), frozen, any MTP head removed."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from ..forward.qwen3_5 import build, model_classes

    model, _ = load_model(folder, get_model_classes=model_classes)
    model.detach_mtp()
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    build(model, None, dtype=mx.float32)
    model.freeze()
    mx.eval(model.parameters())
    return model


def new_head(model, init_layer_from: str = "last-full"):
    import mlx.core as mx
    import mlx.nn as nn

    from ..forward.qwen3_5 import MTP

    args = model.language_model.args
    head = MTP(args, 1)
    head.set_dtype(mx.float32)
    h = args.hidden_size
    # fc starts as "the hidden state plus a little of the next token" so the layer sees a sane input
    w = mx.random.normal((h, 2 * h)) * 0.02
    w[:, h:] = w[:, h:] + mx.eye(h)
    head.fc.weight = w
    if init_layer_from == "last-full":
        full = [layer for layer in model.layers if not layer.is_linear]
        src = dict(nn.utils.tree_flatten(full[-1].parameters())) if full else {}
        mine = dict(nn.utils.tree_flatten(head.layers[0].parameters()))
        same = {k: mx.array(v) for k, v in src.items() if k in mine and mine[k].shape == v.shape}
        head.layers[0].load_weights(list(same.items()), strict=False)
    head.unfreeze()
    return head


def pairs(model, rows):
    """(embeddings of x_p, hidden states h_{p-1} with zeros at p = 0, the model's log-probs of
    x_{p+1} at p) for rows [B, T]: the head's inputs and its distillation target."""
    import mlx.core as mx

    from ..forward import SCORE

    logits, h = model(rows, phase=SCORE, return_hidden=True)
    prev = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    emb = model.model.embed_tokens(rows)
    target = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.stop_gradient(emb), mx.stop_gradient(prev), mx.stop_gradient(target)


def head_logits(model, head, emb, prev, cache=None, phase=None):
    from ..forward import TRAIN

    out = head(emb, prev, cache=cache, phase=phase or TRAIN)
    return model.language_model.head(out, phase or TRAIN)


def agreement(model, head, rows, weights) -> tuple[float, float]:
    """(share of weighted positions where the head's first choice of x_{p+1} is the model's,
    mean KL of the model's distribution to the head's), on rows [B, T]."""
    import mlx.core as mx

    from ..forward import SCORE

    emb, prev, target = pairs(model, rows)
    logits = head_logits(model, head, emb, prev, phase=SCORE)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    w = weights[:, 1:]  # position p predicts x_{p+1}: count where x_{p+1} is the assistant's
    same = (mx.argmax(lp, -1) == mx.argmax(target, -1))[:, :-1]
    kl = (mx.exp(target) * (target - lp)).sum(-1)[:, :-1]
    n = w.sum()
    return float(((same * w).sum() / n).item()), float(((kl * w).sum() / n).item())


def train_mtp(cfg: MtpConfig, log=print) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    folder = Path(cfg.model)
    mx.random.seed(cfg.seed)
    model = load_frozen(folder)
    head = new_head(model, cfg.init_layer_from)
    tc, tokenizer, fast = _corpus(cfg, folder)

    def loss_fn(head, emb, prev, target, weights):
        logits = head_logits(model, head, emb, prev)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = -(mx.exp(target) * lp).sum(-1)[:, :-1]
        w = weights[:, 1:]
        return (ce * w).sum() / mx.maximum(w.sum(), 1)

    def lr(step):
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
        return cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * min(1.0, step / cfg.steps)))

    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    step_fn = nn.value_and_grad(head, loss_fn)
    eval_at = 10**6  # held-out draws: far from any training step of this run or the model's
    held = [_batch(tc, eval_at + i, tokenizer, fast) for i in range(max(1, cfg.eval_rows // cfg.rows))]

    def evaluate():
        a = [agreement(model, head, r, w) for r, w in held]
        return sum(x for x, _ in a) / len(a), sum(k for _, k in a) / len(a)

    before = evaluate()
    log(f"mtp: start, held-out agreement {before[0]:.3f}, KL {before[1]:.3f}")
    started, history = time.time(), []
    for step in range(cfg.steps):
        rows, weights = _batch(tc, step, tokenizer, fast)
        emb, prev, target = pairs(model, rows)
        opt.learning_rate = lr(step)
        loss, grads = step_fn(head, emb, prev, target, weights)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        if step % 50 == 0 or step == cfg.steps - 1:
            history.append(round(float(loss.item()), 4))
            log(f"mtp: step {step}/{cfg.steps} loss {history[-1]:.4f} ({time.time() - started:.0f} s)")
    after = evaluate()
    log(f"mtp: done, held-out agreement {after[0]:.3f} (was {before[0]:.3f}), KL {after[1]:.3f}")
    info = {"config": asdict(cfg), "loss_history_every_50": history, "seconds": round(time.time() - started),
            "heldout_agreement": round(after[0], 4), "heldout_kl": round(after[1], 4)}
    info["config"]["model"] = folder.name
    write_head(folder, head, info)
    return info


def write_head(folder: Path, head, info: dict) -> None:
    """Adds the head's tensors to the folder's `model.safetensors` (the model's own tensors kept
    bit for bit), sets `mtp_num_hidden_layers`, records `info` under training.json's "mtp"."""
    import mlx.core as mx
    import mlx.nn as nn

    path = folder / "model.safetensors"
    tensors = {k: v for k, v in mx.load(str(path)).items() if not k.startswith("mtp.")}
    for name, value in nn.utils.tree_flatten(head.parameters()):
        key = "mtp." + name
        if key.endswith(HF_NORMS):
            value = value - 1.0  # published checkpoints store these zero-centred
        tensors[key] = value.astype(mx.bfloat16)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "pt"})
    tmp.replace(path)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    training_path = folder / "training.json"
    training = json.loads(training_path.read_text()) if training_path.exists() else {}
    training["mtp"] = info
    training_path.write_text(json.dumps(training, indent=1) + "\n")
