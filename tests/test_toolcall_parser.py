"""Whole-text parsing of reasoning and tool calls in both Qwen formats."""

import json

from mixbit.models.training.catalogue import FUNCTIONS_BY_NAME
from mixbit.models.chat.toolcall import (JsonToolParser, XmlToolParser, convert_value, parse_output,
                                    parser_for_template)

XML = XmlToolParser()
TOOLS = [FUNCTIONS_BY_NAME[n].schema() for n in ("get_weather", "convert_currency", "set_timer")]


def call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_xml_call_with_types_from_schema():
    out = parse_output(call("convert_currency", amount="250", from_currency="USD", to_currency="EUR"),
                       XML, TOOLS, prompt_opened_think=False)
    assert out.content == "" and not out.errors
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("convert_currency", {"amount": 250, "from_currency": "USD", "to_currency": "EUR"})]
    out = parse_output(call("set_timer", minutes="15"), XML, TOOLS, False)
    assert out.tool_calls[0].arguments == {"minutes": 15}
    assert isinstance(out.tool_calls[0].arguments["minutes"], int)


def test_multiline_value_and_parallel_calls():
    text = (call("get_weather", city="Oslo") + "\n" + call("get_weather", city="New York"))
    out = parse_output(text, XML, TOOLS, False)
    assert [c.arguments["city"] for c in out.tool_calls] == ["Oslo", "New York"]
    multi = parse_output(call("get_weather", city="line one\nline two"), XML, TOOLS, False)
    assert multi.tool_calls[0].arguments["city"] == "line one\nline two"


def test_reasoning_split_and_call_inside_think():
    text = "the user wants weather\n</think>\n\n" + call("get_weather", city="Oslo")
    out = parse_output(text, XML, TOOLS, prompt_opened_think=True)
    assert out.reasoning == "the user wants weather"
    assert out.tool_calls[0].arguments == {"city": "Oslo"}
    # a call written before </think> is not lost
    inside = "I will call it " + call("get_weather", city="Rome") + "\n</think>\n\nDone."
    out = parse_output(inside, XML, TOOLS, prompt_opened_think=True)
    assert out.tool_calls[0].arguments == {"city": "Rome"} and out.content == "Done."
    assert "<tool_call>" not in (out.reasoning or "")


def test_plain_text_and_unclosed_think():
    out = parse_output("Hello there.", XML, TOOLS, False)
    assert out.content == "Hello there." and not out.tool_calls
    out = parse_output("still thinking", XML, TOOLS, prompt_opened_think=True)
    assert out.reasoning == "still thinking" and out.content == ""


def test_unclosed_final_call_still_parses_and_garbage_is_an_error():
    out = parse_output("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo", XML, TOOLS, False)
    assert out.tool_calls[0].arguments == {"city": "Oslo"}
    bad = parse_output("<tool_call>\nnot a call\n</tool_call>", XML, TOOLS, False)
    assert not bad.tool_calls and bad.errors and "<tool_call>" not in bad.content


def test_json_format():
    p = JsonToolParser()
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    out = parse_output(text, p, TOOLS, False)
    assert out.content == "Sure." and out.tool_calls[0].arguments == {"city": "Oslo"}


def test_parser_choice_follows_template(embedded_path):
    template = (embedded_path / "chat_template.jinja").read_text()
    assert parser_for_template(template).name == "qwen3_xml"
    assert parser_for_template('{"name": <function-name>, "arguments": <args-json-object>}').name == "qwen_json"


def test_convert_value():
    assert convert_value("3", {"type": "integer"}) == 3
    assert convert_value("3.0", {"type": "integer"}) == 3
    assert convert_value("2.5", {"type": "number"}) == 2.5
    assert convert_value("true", {"type": "boolean"}) is True
    assert convert_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert convert_value("Oslo", {"type": "string"}) == "Oslo"
    assert convert_value("007", {"type": "string"}) == "007"
    assert convert_value("abc", {"type": "integer"}) == "abc"  # left as text; validation reports it


def stream_all(text, tools=TOOLS, opened=False, step=1):
    from mixbit.models.chat.toolcall import StreamingOutputParser

    sp = StreamingOutputParser(XML, tools, opened)
    events = []
    for i in range(0, len(text), step):
        events += sp.feed(text[i:i + step])
    return events + sp.finish()


CASES = [
    ("plain answer", False),
    ("reasoning here\n</think>\n\nThe answer." , True),
    ("thinking\n</think>\n\n" + call("get_weather", city="Oslo"), True),
    ("Let me check.\n\n" + call("set_timer", minutes="5") + "\n" + call("get_weather", city="Rome"), False),
    ("<think>\nself opened\n</think>\n\nok", False),
    ("I call " + call("get_weather", city="Oslo") + "\n</think>\n\nDone.", True),
    ("a < b and <tool but not a call", False),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", False),
]


def test_streaming_equals_whole_text_at_every_split():
    for text, opened in CASES:
        whole = parse_output(text, XML, TOOLS, opened)
        for step in (1, 2, 3, 7):
            events = stream_all(text, opened=opened, step=step)
            content = "".join(e.text for e in events if e.kind == "content")
            reasoning = "".join(e.text for e in events if e.kind == "reasoning").strip() or None
            assert content == whole.content, (text, step, content)
            assert reasoning == whole.reasoning, (text, step)
            starts = [e.name for e in events if e.kind == "call_start"]
            assert starts == [c.name for c in whole.tool_calls]
            args = [json.loads(e.text) for e in events if e.kind == "call_args"]
            assert args == [c.arguments for c in whole.tool_calls]
            assert "<tool_call>" not in content and "<think>" not in content


def test_call_name_is_announced_before_its_arguments():
    text = call("get_weather", city="Oslo")
    from mixbit.models.chat.toolcall import StreamingOutputParser

    sp = StreamingOutputParser(XML, TOOLS, False)
    first = sp.feed(text[: text.index("<parameter")])
    assert [e.kind for e in first] == ["call_start"] and first[0].name == "get_weather"
    rest = sp.feed(text[text.index("<parameter"):]) + sp.finish()
    assert [e.kind for e in rest] == ["call_args"] and json.loads(rest[0].text) == {"city": "Oslo"}


def test_without_tools_markup_is_plain_text():
    out = parse_output(call("get_weather", city="Oslo"), XML, None, False)
    assert not out.tool_calls and out.content.startswith("<tool_call>")
