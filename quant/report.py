"""`mixbit eval`: the held-out numbers of one model, as a table and as JSON."""

from __future__ import annotations

import time

from mixbit.models.training import corpus
from mixbit.models.loading import LoadedModel

from .evaluate import agent_soak, heldout_loss_by_kind, tool_call_eval


def unseen_function_eval(lm: LoadedModel, n_tool: int = 120, n_plain: int = 60) -> dict:
    """Functions never seen in training (name, description, a parameter name): a call among
    decoys, two calls in one request, no offered tool fits, a question that needs no tool."""
    calls = tool_call_eval(lm, corpus.unseen_tool_prompts(n_tool))
    two = tool_call_eval(lm, corpus.unseen_two_tool_prompts(max(n_tool // 3, 1)), max_tokens=192)
    no_fit = tool_call_eval(lm, corpus.unseen_no_fit_prompts(n_plain))
    plain = tool_call_eval(lm, corpus.unseen_plain_prompts(n_plain))
    return {
        "calls": {"n": calls.n_tool, **{k: v for k, v in calls.rates().items() if k != "plain_answer"}},
        "two_calls": {"n": two.n_tool, **{k: v for k, v in two.rates().items() if k != "plain_answer"}},
        "no_tool_fits": {"n": no_fit.n_plain, "plain_answer": no_fit.rates()["plain_answer"]},
        "needs_no_tool": {"n": plain.n_plain, "plain_answer": plain.rates()["plain_answer"]},
        "examples_of_failures": (calls.failures[:4] + no_fit.failures[:2] + plain.failures[:2]),
    }


def unseen_lines(u: dict) -> str:
    c, t = u["calls"], u["two_calls"]
    return "\n".join([
        f"functions never seen in training (name, description, a parameter name; among decoys), "
        f"{c['n']} prompts:",
        f"  well-formed call      {c['well_formed']:.1%}",
        f"  right function        {c['right_function']:.1%}",
        f"  exact arguments       {c['exact_args']:.1%}",
        f"two unseen functions in one request ({t['n']} prompts): both right {t['right_function']:.1%}, "
        f"both exact {t['exact_args']:.1%}",
        f"plain answer when no offered tool fits (decoys share its words), {u['no_tool_fits']['n']} "
        f"prompts: {u['no_tool_fits']['plain_answer']:.1%}",
        f"plain answer to a question that needs no tool, unseen tools offered, "
        f"{u['needs_no_tool']['n']} prompts: {u['needs_no_tool']['plain_answer']:.1%}"])


def run_model_eval(lm: LoadedModel, n_tool: int = 120, n_plain: int = 60, n_docs: int = 300,
                   thinking: bool = False, soak_rounds: int = 30) -> dict:
    started = time.time()
    # the catalogue kinds' documents as before, then the generated tool space's kinds
    docs = (corpus.heldout_documents(n_docs)
            + corpus.heldout_documents(max(n_docs // 3, 1), seed=1999, mix=corpus.GENERATED_MIX))
    losses = heldout_loss_by_kind(lm, docs)
    pool = tool_call_eval(lm, corpus.heldout_tool_prompts(n_tool) + corpus.heldout_plain_prompts(n_plain))
    made_up = tool_call_eval(lm, corpus.heldout_tool_prompts(max(n_tool // 2, 1), made_up=True))
    seen = tool_call_eval(lm, corpus.heldout_tool_prompts(n_tool, phrasing="train"))
    novel = tool_call_eval(lm, corpus.heldout_tool_prompts(n_tool, phrasing="novel")
                           + corpus.heldout_plain_prompts(n_plain, phrasing="novel"))
    constrained = tool_call_eval(lm, corpus.heldout_tool_prompts(n_tool), constrained=True)
    unseen = unseen_function_eval(lm, n_tool, n_plain)
    soak = {mode: agent_soak(lm, max_rounds=soak_rounds, constrained=mode == "grammar").__dict__
            for mode in ("free", "grammar")}
    result = {
        "model": lm.resolved.source,
        "heldout_loss": losses,
        "tool_calls": {"n_tool_prompts": pool.n_tool, "n_plain_prompts": pool.n_plain, **pool.rates()},
        "made_up_values": {"n": made_up.n_tool, **{k: v for k, v in made_up.rates().items()
                                                   if k != "plain_answer"}},
        "seen_phrasings_new_values": {"n": seen.n_tool, **{k: v for k, v in seen.rates().items()
                                                          if k != "plain_answer"}},
        "tool_calls_with_grammar": {"n": constrained.n_tool, **{
            k: v for k, v in constrained.rates().items() if k != "plain_answer"}},
        "agent_soak": soak,
        "novel_sentences": {"n_tool_prompts": novel.n_tool, "n_plain_prompts": novel.n_plain,
                            **novel.rates()},
        "unseen_functions": unseen,
        "examples_of_failures": pool.failures[:8],
    }
    if thinking:
        think = tool_call_eval(lm, corpus.heldout_tool_prompts(n_tool) + corpus.heldout_plain_prompts(n_plain),
                               enable_thinking=True)
        result["tool_calls_thinking"] = think.rates()
    result["seconds"] = round(time.time() - started, 1)
    lines = [f"model: {lm.resolved.source}", "", "held-out loss on assistant tokens (nats/token):"]
    lines += [f"  {kind:<10} {value:.3f}" for kind, value in losses.items()]
    r = result["tool_calls"]
    lines += ["", f"tool calls, {r['n_tool_prompts']} held-out prompts (new sentences from known "
              "words, values from training pools):",
              f"  well-formed call      {r['well_formed']:.1%}",
              f"  right function        {r['right_function']:.1%}",
              f"  exact arguments       {r['exact_args']:.1%}",
              f"plain answer, {r['n_plain_prompts']} prompts needing no tool: {r['plain_answer']:.1%}",
              f"training phrasings, (function, value) pairs never seen ({seen.n_tool} prompts): "
              f"well-formed {seen.rates()['well_formed']:.1%}, right function "
              f"{seen.rates()['right_function']:.1%}, exact arguments {seen.rates()['exact_args']:.1%}",
              f"novel whole sentences (words never used for that request; {novel.n_tool} tool, "
              f"{novel.n_plain} plain prompts): well-formed {novel.rates()['well_formed']:.1%}, "
              f"right function {novel.rates()['right_function']:.1%}, exact arguments "
              f"{novel.rates()['exact_args']:.1%}, plain answer {novel.rates()['plain_answer']:.1%}",
              f"same held-out prompts decoded with the server's tool grammar: well-formed "
              f"{constrained.rates()['well_formed']:.1%}, right function "
              f"{constrained.rates()['right_function']:.1%}, exact arguments "
              f"{constrained.rates()['exact_args']:.1%}",
              f"agent soak (4 tools, request -> call -> result -> answer, up to {soak_rounds} rounds): " + ", ".join(
                  f"{m}: {s['rounds']} rounds" + (f" (broke: {s['reason']})" if s["broke_at"] else "")
                  + f", {s['right_calls']} exactly right calls" for m, s in soak.items()),
              f"made-up values never seen ({made_up.n_tool} prompts): well-formed "
              f"{made_up.rates()['well_formed']:.1%}, right function "
              f"{made_up.rates()['right_function']:.1%}, exact arguments {made_up.rates()['exact_args']:.1%}",
              "", unseen_lines(unseen)]
    if thinking:
        t = result["tool_calls_thinking"]
        lines.append(f"with thinking on: well-formed {t['well_formed']:.1%}, right function "
                     f"{t['right_function']:.1%}, exact arguments {t['exact_args']:.1%}, "
                     f"plain answer {t['plain_answer']:.1%}")
    lines.append(f"({result['seconds']} s)")
    result["table"] = "\n".join(lines)
    return result
