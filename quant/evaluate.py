"""Evaluation on held-out data: loss per data kind and tool-call accuracy.

Held-out prompts come from `models.corpus`: phrasings and (function, value) pairs that training
never used. Generation is greedy and batched through mlx-lm's BatchGenerator, prompts rendered with
the checkpoint's own chat template, outputs parsed by the same parser the server uses.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from mixbit.models.training import corpus
from mixbit.models.forward import score
from mixbit.models.loading import LoadedModel
from mixbit.models.chat.template import prompt_opens_think, render_chat
from mixbit.models.chat.toolcall import leaks_markup, parse_output, parser_for_template


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
                   batch_size: int = 16, processors: list[list] | None = None) -> list[str]:
    """Greedy completions; `processors` (one list per prompt) e.g. grammar masks."""
    from mlx_lm.generate import BatchGenerator

    tok = lm.tokenizer
    outputs: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = [tok.encode(p, add_special_tokens=False) for p in prompts[i:i + batch_size]]
        gen = BatchGenerator(lm.model, stop_tokens=[[t] for t in tok.eos_token_ids])
        procs = processors[i:i + batch_size] if processors else None
        uids = gen.insert(chunk, [max_tokens] * len(chunk), logits_processors=procs)
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        while True:
            responses = gen.next_generated()  # prompt logits stay lazy (PREFILL), as in the engine
            if not responses:
                break
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
        gen.close()
        outputs += [tok.decode(tokens[u]) for u in uids]
    return outputs


def tool_grammar_processors(lm: LoadedModel, prompts: list[corpus.ToolPrompt],
                            enable_thinking: bool = False, engine=None) -> list[list]:
    """What the server does under tool_choice auto: calls may only name offered functions, in
    the template's format, arguments following the schema."""
    from mixbit.models.chat.grammar import GrammarEngine, chat_grammar

    if engine is None:
        cfg = lm.config.get("text_config", lm.config)
        engine = GrammarEngine(lm.hf_tokenizer, int(cfg["vocab_size"]),
                               sorted(lm.tokenizer.eos_token_ids))
    fmt = "json" if type(parser_for_template(lm.chat_template)).__name__ == "JsonToolParser" else "xml"
    out = []
    for p in prompts:
        strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in p.tools]
        grammar = chat_grammar(strict, "auto", True, None, enable_thinking, fmt)
        out.append([engine.processor(engine.compile(grammar))])
    return out


def tool_call_eval(lm: LoadedModel, prompts: list[corpus.ToolPrompt], enable_thinking: bool = False,
                   max_tokens: int = 96, constrained: bool = False) -> ToolEval:
    parser = parser_for_template(lm.chat_template)
    texts = [render_chat(lm.tokenizer, p.messages, p.tools, enable_thinking) for p in prompts]
    procs = tool_grammar_processors(lm, prompts, enable_thinking) if constrained else None
    outs = generate_batch(lm, texts, max_tokens=max_tokens + (64 if enable_thinking else 0),
                          processors=procs)
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
        # a request that needs several calls is right only when every call is, in order
        expected = p.expected_all or [p.expected]
        calls = parsed.tool_calls[:len(expected)] if parsed.tool_calls else []
        formed = (len(calls) == len(expected) and not parsed.errors and "</tool_call>" in out
                  and all(c.name in offered for c in calls))
        ev.well_formed += formed
        right = formed and [c.name for c in calls] == [e["name"] for e in expected]
        ev.right_function += right
        exact = right and all(args_match(c.arguments, e["arguments"]) for c, e in zip(calls, expected))
        ev.exact_args += exact
        if not exact:
            ev.failures.append({"prompt": p.messages[-1]["content"], "expected": p.expected,
                                "output": out})
    return ev


def heldout_loss_by_kind(lm: LoadedModel, docs: list[dict], batch_size: int = 8) -> dict[str, float]:
    """Mean next-token loss (nats) on assistant tokens of held-out documents, per kind."""
    import mlx.core as mx
    import mlx.nn as nn

    from mixbit.models.training.train import encode_with_targets

    tok = lm.tokenizer
    fast = tok.backend_tokenizer
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
        logits = score(lm.model, x[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none") * w[:, 1:]
        per_doc = nll.sum(axis=1).tolist()
        per_cnt = w[:, 1:].sum(axis=1).tolist()
        for (kind, _, _), s, c in zip(chunk, per_doc, per_cnt):
            total[kind] += s
            count[kind] += c
    return {k: total[k] / count[k] for k in sorted(total) if count[k]}


@dataclass
class SoakResult:
    rounds: int  # rounds completed with a tool call and a clean answer
    broke_at: int | None  # first round that leaked markup or stopped calling tools, else None
    reason: str = ""
    right_calls: int = 0  # rounds whose call had the right function and exact arguments
    tokens: int = 0  # conversation length at the end
    output: str = ""  # what the model returned in the round that broke
    played: int = 0  # rounds played (a soak that goes on after a break; 0: it stopped there)
    failed: int = 0  # of those, rounds that broke


class SoakScript:
    """The user and the tools of an agent soak: `n_tools` held-out tools, a new request each round,
    and a result for whatever the model called. The in-process soak and the one through the served
    API (quant/soak.py) play the same script, so their rounds compare."""

    def __init__(self, seed: int = 77, n_tools: int = 4):
        import random

        from mixbit.models.training import catalogue

        self.rng = random.Random(seed)
        self.functions = self.rng.sample(catalogue.FUNCTIONS, n_tools)
        self.tools = [f.schema() for f in self.functions]  # OpenAI's shape
        self.fn = self.functions[0]
        self.args: dict[str, str] = {}

    def request(self) -> str:
        """The next user request; remembers which call it asks for."""
        self.fn = self.rng.choice(self.functions)
        self.args = corpus.sample_args(self.fn, self.rng, "heldout")
        return corpus.request_text(self.fn, self.args, self.rng, "heldout")

    def right(self, name: str, arguments: dict) -> bool:
        return name == self.fn.name and args_match(arguments, corpus.typed(self.fn, self.args))

    def result(self, name: str, arguments: dict) -> str:
        """JSON text of the called tool's result (an error for arguments it cannot use)."""
        import json

        called = next((f for f in self.functions if f.name == name), self.fn)
        try:
            result = corpus.tool_result(called, {p.name: str(arguments.get(p.name, ""))
                                                 for p in called.params}, self.rng)
        except (KeyError, ValueError, ZeroDivisionError):
            result = {"error": "bad arguments"}
        return json.dumps(result)


def agent_soak(lm: LoadedModel, max_rounds: int = 30, seed: int = 77, constrained: bool = False,
               n_tools: int = 4, context: int | None = None) -> SoakResult:
    """A multi-turn agent loop with `n_tools` tools, in process: request -> tool call -> tool
    result -> answer -> next request, until the context is full or `max_rounds`. Reports the first
    round where the model leaks tool-call markup into content or stops calling tools (what breaks
    uniformly quantized Qwen3.5 after a few rounds), and how many calls were exactly right."""
    script = SoakScript(seed, n_tools)
    tools = script.tools
    parser = parser_for_template(lm.chat_template)
    cfg = lm.config.get("text_config", lm.config)
    context = context or int(cfg.get("max_position_embeddings", 4096))
    messages: list[dict] = []
    right = used = 0
    for round_no in range(1, max_rounds + 1):
        messages.append({"role": "user", "content": script.request()})
        prompt = render_chat(lm.tokenizer, messages, tools)
        used = len(lm.tokenizer.encode(prompt, add_special_tokens=False))
        if used + 200 > context:
            return SoakResult(round_no - 1, None, "context full", right, used)
        probe = corpus.ToolPrompt(messages=list(messages), tools=tools, expected=None, value_kind="pool")
        procs = tool_grammar_processors(lm, [probe]) if constrained else None
        out = generate_batch(lm, [prompt], max_tokens=96, processors=procs)[0]
        parsed = parse_output(out, parser, tools, prompt_opens_think(prompt))
        if leaks_markup(parsed.content):
            return SoakResult(round_no - 1, round_no, "markup in content", right, used, out)
        if not parsed.tool_calls:
            return SoakResult(round_no - 1, round_no, "no tool call", right, used, out)
        call = parsed.tool_calls[0]
        right += script.right(call.name, call.arguments)
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]})
        messages.append({"role": "tool", "content": script.result(call.name, call.arguments)})
        answer_prompt = render_chat(lm.tokenizer, messages, tools)
        probe = corpus.ToolPrompt(messages=list(messages), tools=tools, expected=None, value_kind="pool")
        procs = tool_grammar_processors(lm, [probe]) if constrained else None
        answer = generate_batch(lm, [answer_prompt], max_tokens=64, processors=procs)[0]
        parsed = parse_output(answer, parser, tools, prompt_opens_think(answer_prompt))
        if leaks_markup(parsed.content) or parsed.tool_calls:
            return SoakResult(round_no - 1, round_no, "tool call instead of an answer", right, used, answer)
        messages.append({"role": "assistant", "content": parsed.content})
    return SoakResult(max_rounds, None, "", right, used)
