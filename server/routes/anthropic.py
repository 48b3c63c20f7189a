"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), mapped onto a chat plan
with its thinking budget."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from .. import anthropic, errors
from ..deps import auth, pick, server_state
from ..errors import APIError
from ..planning import chat_plan, render_prompt
from ..protocol import ChatCompletionRequest
from ..serving import account, collect, release, start_choices, stream_message

router = APIRouter()


def messages_chat(request: Request, req: anthropic.CountTokensRequest):
    """A Messages request as the chat request it maps onto, with its thinking budget."""
    st = pick(server_state(request), req.model)
    think_end = tuple(st.lm.tokenizer.encode("</think>", add_special_tokens=False))
    body, budget = anthropic.chat_body(req, think_end)
    try:
        return st, ChatCompletionRequest.model_validate(body), budget, think_end
    except ValidationError as exc:
        raise errors.validation_error(exc) from None


@router.post("/v1/messages", dependencies=[Depends(auth)])
async def messages(req: anthropic.MessagesRequest, request: Request):
    st, chat, budget, think_end = messages_chat(request, req)
    try:
        plan = chat_plan(st, chat, fit_max_tokens=True)
    except APIError as exc:
        if exc.code == "context_length_exceeded":  # the words Claude Code looks for
            exc.message = f"prompt is too long: {exc.message}"
        raise
    plan.endpoint = "/v1/messages"
    if budget:
        plan.params.think_budget, plan.params.think_end = budget, think_end
    (choice,) = start_choices(st, plan, 1)
    builder = anthropic.MessageBuilder(st.served_id, len(plan.prompt_ids), plan.parallel)
    if req.stream:
        return EventSourceResponse(stream_message(st, request, plan, choice, builder), ping=15, send_timeout=30)
    try:
        await collect(request, st, [choice])
    finally:
        release(st, [choice])
    builder.feed(choice.feed(choice.text, final=True))
    builder.finish(choice.finish)
    account(st, plan, [choice], builder.id)
    return builder.final


@router.post("/v1/messages/count_tokens", dependencies=[Depends(auth)])
async def count_tokens(req: anthropic.CountTokensRequest, request: Request):
    st, chat, _, _ = messages_chat(request, req)
    _, ids, _ = render_prompt(st, chat)
    return {"input_tokens": len(ids)}
