"""OpenAI's Responses API (/v1/responses): mapped onto a chat plan, with stored conversations
for `previous_response_id`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from .. import errors
from ..deps import auth, pick, server_state
from ..errors import APIError
from ..planning import chat_plan
from ..protocol import ChatCompletionRequest
from ..responses import ResponseBuilder, ResponsesRequest, chat_body, responses_param, usage_of
from ..serving import account, collect, release, start_choices, stream_response

router = APIRouter()


@router.post("/v1/responses", dependencies=[Depends(auth)])
async def responses(req: ResponsesRequest, request: Request):
    st = pick(server_state(request), req.model)
    history: list[dict] = []
    if req.previous_response_id:
        found = st.responses.get(req.previous_response_id)
        if found is None:
            raise APIError(404, f"no stored response {req.previous_response_id!r} (this server "
                           f"keeps the last {st.responses.capacity}, in memory)",
                           param="previous_response_id", code="response_not_found")
        history = found
    body = chat_body(req, history)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = responses_param(errors.param_of(first["loc"]))
        msg = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}", param=param, code="invalid_value") from None
    try:
        plan = chat_plan(st, chat)
    except APIError as exc:  # named as the Responses request names its fields
        exc.param = responses_param(exc.param) if exc.param else exc.param
        raise
    plan.endpoint = "/v1/responses"
    (choice,) = start_choices(st, plan, 1)
    builder = ResponseBuilder(req, st.served_id)
    # what a continuation sees: the messages without this request's instructions
    conversation = body["messages"][1:] if req.instructions else body["messages"]
    if req.stream:
        return EventSourceResponse(stream_response(st, request, plan, choice, builder, conversation),
                                   ping=15, send_timeout=30)
    try:
        await collect(request, st, [choice])
    finally:
        release(st, [choice])
    events = choice.feed(choice.text, final=True)
    builder.feed(events, plan.parallel)
    builder.finish(choice.finish.reason if choice.finish else "stop", usage_of(choice.finish))
    account(st, plan, [choice], builder.id)
    if req.store:
        st.responses.put(builder.id, conversation + builder.messages())
    length = choice.finish is not None and choice.finish.reason == "length"
    return builder.response("incomplete" if length else "completed", usage_of(choice.finish),
                            "max_output_tokens" if length else None)
