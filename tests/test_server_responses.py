"""POST /v1/responses through the official openai SDK: function calls and their outputs, the
streamed event sequence, structured output, reasoning items, continuation by
previous_response_id, and clear errors."""

from __future__ import annotations

import json

import openai
import pytest

from .server_proc import ServerProcess

MODEL = "tiny-qwen3.5"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def client():
    s = ServerProcess("server.request_timeout_s=120").wait_ready()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    s.stop()


def test_function_call_then_its_output_then_the_answer(client):
    r = client.responses.create(model=MODEL, input="What's the weather in Oslo?", tools=[WEATHER], temperature=0)
    assert r.status == "completed" and r.usage.input_tokens > 0
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"}
    r2 = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, input=[
        {"role": "user", "content": "What's the weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": json.dumps({"city": "Oslo", "temperature_c": 12, "condition": "rainy"})}])
    assert r2.output[0].type == "message"
    assert "12" in r2.output_text and "<tool_call>" not in r2.output_text


def test_stream_events_come_in_order_and_add_up(client):
    kwargs = dict(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], temperature=0)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        types = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert "response.output_item.added" in types and "response.function_call_arguments.delta" in types
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.done") \
        < types.index("response.output_item.done")
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == \
        [(o.name, json.loads(o.arguments)) for o in plain.output]


def test_streamed_text_deltas_make_the_message(client):
    with client.responses.stream(model=MODEL, input="Tell me a joke.", temperature=0) as stream:
        deltas = [ev.delta for ev in stream if ev.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas and "".join(deltas) == final.output_text


def test_structured_output_and_forced_tool(client):
    r = client.responses.create(model=MODEL, input="JSON please: name Leo, age 40.", temperature=0, text={
        "format": {"type": "json_schema", "name": "person", "strict": True, "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}}})
    assert set(json.loads(r.output_text)) == {"name", "age"}
    r = client.responses.create(model=MODEL, input="Tell me a joke.", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in r.output] == ["function_call"]


def test_reasoning_item_when_thinking(client):
    r = client.responses.create(model=MODEL, input="What's the weather in Oslo?", tools=[WEATHER],
                                temperature=0, reasoning={"effort": "medium"})
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and "function_call" in kinds, kinds
    assert r.output[0].content[0].text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Hi, I am Nora.", temperature=0)
    follow = client.responses.create(model=MODEL, input="What is 2 plus 3?", previous_response_id=first.id,
                                     temperature=0)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")


def test_unsupported_tools_and_inputs_get_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert "input_image" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True)
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=4).status in ("completed", "incomplete")
