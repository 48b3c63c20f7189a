"""Evaluation on held-out data: loss per data kind and tool-call accuracy.

Held-out prompts come from `models.corpus`: phrasings and (function, value) pairs that training
never used. Generation is greedy and batched through mlx-lm's BatchGenerator, prompts rendered with
the checkpoint's own chat template, outputs parsed by the same parser the server uses.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from mixbit.models import corpus
from mixbit.models.loading import LoadedModel, prompt_opens_think, render_chat
from mixbit.models.toolcall import parse_output, parser_for_template


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-9)
    return a == b


def args_match(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(_same(got[k], expected[k]) for k in expected)


@dataclass
class ToolEval:
    n_tool: int = 0
    well_formed: int = 0
    right_function: int = 0
    exact_args: int = 0
    n_plain: int = 0
    plain_ok: int = 0
    failures: list[dict] = field(default_factory=list)

    def rates(self) -> dict[str, float]:
        t = max(self.n_tool, 1)
        return {"well_formed": self.well_formed / t, "right_function": self.right_function / t,
                "exact_args": self.exact_args / t,
                "plain_answer": self.plain_ok / max(self.n_plain, 1)}


def generate_batch(lm: LoadedModel, prompts: list[str], max_tokens: int = 96,
                   batch_size: int = 16) -> list[str]:
    from mlx_lm.generate import batch_generate

    tok = lm.tokenizer
    outputs: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = [tok.encode(p, add_special_tokens=False) for p in prompts[i:i + batch_size]]
        res = batch_generate(lm.model, tok, chunk, max_tokens=max_tokens)
        outputs += list(res.texts)
    return outputs


def tool_call_eval(lm: LoadedModel, prompts: list[corpus.ToolPrompt], enable_thinking: bool = False,
                   max_tokens: int = 96) -> ToolEval:
    parser = parser_for_template(lm.chat_template)
    texts = [render_chat(lm.tokenizer, p.messages, p.tools, enable_thinking) for p in prompts]
    outs = generate_batch(lm, texts, max_tokens=max_tokens + (64 if enable_thinking else 0))
    ev = ToolEval()
    for p, prompt, out in zip(prompts, texts, outs):
        parsed = parse_output(out, parser, p.tools, prompt_opens_think(prompt))
        offered = {t["function"]["name"] for t in p.tools}
        if p.expected is None:
            ev.n_plain += 1
            ok = (not parsed.tool_calls and not parsed.errors and "<tool_call>" not in parsed.content
                  and bool(parsed.content))
            ev.plain_ok += ok
            if not ok:
                ev.failures.append({"prompt": p.messages[-1]["content"], "output": out})
            continue
        ev.n_tool += 1
        call = parsed.tool_calls[0] if parsed.tool_calls else None
        formed = (call is not None and not parsed.errors and call.name in offered
                  and "</tool_call>" in out)
        ev.well_formed += formed
        right = formed and call.name == p.expected["name"]
        ev.right_function += right
        exact = right and args_match(call.arguments, p.expected["arguments"])
        ev.exact_args += exact
        if not exact:
            ev.failures.append({"prompt": p.messages[-1]["content"], "expected": p.expected,
                                "output": out})
    return ev


def heldout_loss_by_kind(lm: LoadedModel, docs: list[dict], batch_size: int = 8) -> dict[str, float]:
    """Mean next-token loss (nats) on assistant tokens of held-out documents, per kind."""
    import mlx.core as mx
    import mlx.nn as nn

    from mixbit.models.train import encode_with_targets

    tok = lm.tokenizer
    fast = tok._tokenizer.backend_tokenizer
    items = []
    for doc in docs:
        text = tok.apply_chat_template(doc["messages"], tools=doc["tools"], tokenize=False,
                                       enable_thinking=doc["enable_thinking"])
        ids, weights = encode_with_targets(fast, text)
        items.append((doc["kind"], ids, weights))
    items.sort(key=lambda it: len(it[1]))
    total = defaultdict(float)
    count = defaultdict(float)
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        width = max(len(ids) for _, ids, _ in chunk)
        pad = tok.eos_token_id or 0
        x = mx.array([ids + [pad] * (width - len(ids)) for _, ids, _ in chunk])
        w = mx.array([wt + [0.0] * (width - len(wt)) for _, _, wt in chunk])
        logits = lm.model(x[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none") * w[:, 1:]
        per_doc = nll.sum(axis=1).tolist()
        per_cnt = w[:, 1:].sum(axis=1).tolist()
        for (kind, _, _), s, c in zip(chunk, per_doc, per_cnt):
            total[kind] += s
            count[kind] += c
    return {k: total[k] / count[k] for k in sorted(total) if count[k]}
