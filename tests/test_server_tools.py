"""Tool calls and structured output through the real server and the official openai SDK:
forced and named calls, strict functions, streamed calls that accumulate like non-streamed ones,
`chat.completions.parse` with a pydantic model, JSON modes, and clear refusals."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .server_proc import ServerProcess

MODEL = "tiny-qwen3.5"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Name of the city"}},
                   "required": ["city"]}}}
TIMER = {"type": "function", "function": {
    "name": "set_timer", "description": "Start a countdown timer.",
    "parameters": {"type": "object", "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 90, "description": "Length in minutes"}},
        "required": ["minutes"]}}}
TOOLS = [WEATHER, TIMER]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("server.request_timeout_s=120").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid(call) -> None:
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("prompt", ["Tell me a joke.", "Hi, I am Anna.", "What is 2 plus 2?"])
def test_required_always_returns_valid_calls(client, prompt):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            _valid(call)


def test_named_function_is_called_even_when_another_fits_better(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_timer"}}, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["set_timer"]
    assert 1 <= json.loads(calls[0].function.arguments)["minutes"] <= 90


def test_parallel_tool_calls_false_gives_one_call(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo and in Paris?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_calls_accumulate_to_the_non_streamed_response(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}],
                  tools=TOOLS, tool_choice="required", temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert not final.message.content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in plain.tool_calls]
    assert got == want and got


def test_strict_function_under_auto_gets_schema_valid_arguments(client):
    strict_timer = {"type": "function", "function": {**TIMER["function"], "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Set a timer for 500 minutes."}],
            tools=[WEATHER, strict_timer], temperature=1.0, seed=seed)
        for call in r.choices[0].message.tool_calls or []:
            if call.function.name == "set_timer":
                args = json.loads(call.function.arguments)
                assert set(args) == {"minutes"} and 1 <= args["minutes"] <= 90


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, response_format=Person, temperature=0,
        messages=[{"role": "user", "content": "Make a JSON object for Anna who is 31 years old, keys name and age."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)
    assert (person.name, person.age) == ("Anna", 31)  # the embedded model learned JSON answers


def test_json_schema_strict_and_json_object_always_parse(client):
    schema = {"type": "object", "properties": {"item": {"type": "string", "maxLength": 20},
                                               "quantity": {"type": "integer", "minimum": 1, "maximum": 12}},
              "required": ["item", "quantity"]}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}], temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}})
        obj = json.loads(r.choices[0].message.content)
        jsonschema.validate(obj, {**schema, "additionalProperties": False})
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please: name Leo, age 40."}],
        response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_thinking_and_json_coexist(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please: name Leo, age 40."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
        temperature=0, max_tokens=300, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.model_extra.get("reasoning_content")  # reasoning stayed free
    jsonschema.validate(json.loads(choice.message.content), schema)  # the answer is constrained


def test_constrained_and_free_requests_share_the_batch(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        free = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                                                tools=TOOLS, temperature=0) for _ in range(3)]
        forced = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}],
                                                  tools=TOOLS, tool_choice="required", temperature=1.0, seed=i)
                  for i in range(3)]
        return await asyncio.gather(*free, *forced)

    results = asyncio.run(main())
    for r in results[:3]:  # unconstrained: the model's own answer, same for all three
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    for r in results[3:]:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            _valid(call)


def test_unenforceable_requests_get_a_400_naming_the_feature(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}])
    assert "pattern" in err.value.body["message"] and err.value.body["param"].startswith("tools[0]")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}})
    assert "no-such-format" in err.value.body["message"]
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"
    # still serving
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message is not None
