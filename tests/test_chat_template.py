"""The embedded chat template renders exactly Qwen3.5's format (golden strings)."""

import pytest

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}

TOOLS_BLOCK = (
    '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n'
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n'
    '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n'
    '</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n'
    'that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n'
    '- Function calls MUST follow the specified format: an inner <function=...></function> block must '
    'be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n'
    '- You may provide optional reasoning for your function call in natural language BEFORE the '
    'function call, but NOT after\n- If there is no function call available, answer the question like '
    'normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>'
)


@pytest.fixture(scope="module")
def tok(embedded_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_path))


def render(tok, messages, tools=None, **kw):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)


def test_plain_chat_generation_prompt_thinking_switch(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, msgs, add_generation_prompt=True) == head + "<think>\n"
    assert render(tok, msgs, add_generation_prompt=True, enable_thinking=False) == head + "<think>\n\n</think>\n\n"


def test_tools_in_system_prompt_with_user_system_text_after(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    text = render(tok, msgs, tools=[TOOL], add_generation_prompt=True, enable_thinking=False)
    assert text == (TOOLS_BLOCK + "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_call_and_tool_response_round_trip(tok):
    msgs = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"temperature_c": 12}'},
        {"role": "tool", "content": '{"extra": 1}'},
        {"role": "assistant", "content": "It is 12 degrees."},
    ]
    text = render(tok, msgs, tools=[TOOL])
    assert text == (TOOLS_BLOCK + "<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "</function>\n</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n{\"temperature_c\": 12}\n</tool_response>\n"
                    "<tool_response>\n{\"extra\": 1}\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 12 degrees.<|im_end|>\n")


def test_history_before_last_query_drops_reasoning_and_content_precedes_calls(tok):
    msgs = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "hidden",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Rome", "days": 2, "opts": {"u": "c"}}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "r1"},
        {"role": "user", "content": "B"},
    ]
    text = render(tok, msgs, add_generation_prompt=True, enable_thinking=False)
    assert "hidden" not in text
    assert ("<|im_start|>assistant\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "<parameter=opts>\n{\"u\": \"c\"}\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\nB<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_think_in_content_is_split_into_reasoning(tok):
    msgs = [{"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>\nponder\n</think>\n\nAnswer"}]
    assert render(tok, msgs).endswith("<|im_start|>assistant\n<think>\nponder\n</think>\n\nAnswer<|im_end|>\n")


def test_template_is_the_one_shipped_with_the_code(embedded_path):
    from mixbit.models.training.tokenizer import CHAT_TEMPLATE_PATH

    assert (embedded_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE_PATH.read_text()
