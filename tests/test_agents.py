"""Agent frameworks against the running server, as their users run them: an openai-agents agent
(its default Responses model and its chat-completions model) whose Python tool is called through
the server and whose answer carries the tool's result, and a LangChain ChatOpenAI with bound
tools. The embedded model was trained for tool calls, so these calls are the model's own
(tool_choice auto), not forced."""

from __future__ import annotations

import json

import pytest

from .server_proc import ServerProcess

MODEL = "tiny-qwen3.5"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("server.request_timeout_s=120").wait_ready()
    yield s
    s.stop()


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_runs_a_python_tool_through_the_server(server, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        called.append(city)
        return json.dumps({"city": city, "temperature_c": 17, "condition": "sunny"})

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(MODEL, client) if api == "responses" else \
        OpenAIChatCompletionsModel(MODEL, client)
    agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(temperature=0))
    result = Runner.run_sync(agent, "What's the weather in Lisbon?", max_turns=4)
    assert called and called[0] == "Lisbon"
    assert "Lisbon" in result.final_output and "17" in result.final_output, result.final_output
    assert "<tool_call>" not in result.final_output


def test_langchain_bound_tools(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_current_time(city: str) -> str:
        """Get the current local time in a city."""
        return json.dumps({"city": city, "time": "09:41"})

    @tool
    def get_stock_price(ticker: str) -> str:
        """Get the latest stock price for a ticker symbol."""
        return json.dumps({"ticker": ticker, "price": "123.45"})

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0,
                     max_retries=0).bind_tools([get_current_time, get_stock_price])
    question = HumanMessage("What time is it in Tokyo?")
    first = llm.invoke([question])
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_current_time", {"city": "Tokyo"})]
    call = first.tool_calls[0]
    result = get_current_time.invoke(call["args"])
    final = llm.invoke([question, first, ToolMessage(result, tool_call_id=call["id"])])
    assert not final.tool_calls
    assert "09:41" in final.content, final.content  # the tool result came back through the server
