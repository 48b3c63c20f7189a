"""Rendering a conversation through the checkpoint's own chat template (as transformers renders
it), and what a rendered prompt says about thinking."""

from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                enable_thinking: bool = False, add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text through the checkpoint's own chat template (as transformers renders it)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking, **kwargs)


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` block."""
    tail = prompt.rstrip()
    return tail.endswith("<think>")
