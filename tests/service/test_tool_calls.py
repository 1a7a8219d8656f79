"""kvops/intake/tool_calls.py: what each tool_choice asks of the output, and how an `auto`
answer's Hermes-style <tool_call> blocks become OpenAI tool_calls."""
import json

import pytest

from kvops.intake import tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_modes():
    assert tool_calls.parse({}) is None
    assert tool_calls.parse({"tools": TOOLS, "tool_choice": "none"}) is None
    auto = tool_calls.parse({"tools": TOOLS})
    assert auto == {"kind": "auto", "names": ["get_weather", "get_time"], "structured": None}
    named = tool_calls.parse({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert named["structured"] == {"json": TOOLS[0]["function"]["parameters"]}
    required = tool_calls.parse({"tools": TOOLS, "tool_choice": "required",
                                 "parallel_tool_calls": False})
    assert required["structured"]["json"]["maxItems"] == 1
    for body, param in [({"tool_choice": "auto"}, "tool_choice"),
                        ({"tools": [{"type": "x"}]}, "tools"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"functions": [{"name": "f"}]}, "functions")]:
        with pytest.raises(tool_calls.ToolError) as e:
            tool_calls.parse(body)
        assert e.value.param == param


def test_auto_answers_split_into_content_and_calls():
    mode = tool_calls.parse({"tools": TOOLS})
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = tool_calls.split_auto(text, mode)
    assert content == "Let me look."
    assert calls == [("get_weather", json.dumps({"city": "Paris"})), ("get_time", "{}")]
    out = tool_calls.calls_of(mode, text, "call_7")
    assert [c["id"] for c in out] == ["call_7-0", "call_7-1"]
    assert out[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Not a call of a given tool, or not JSON: the text stays as it is.
    for odd in ['<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                "<tool_call>not json</tool_call>", "no calls at all"]:
        assert tool_calls.split_auto(odd, mode) == (odd, [])
    # While streaming, content stops where a call (or what may start one) begins.
    assert tool_calls.visible_auto("Let me look. <tool_call>{", final=False) == "Let me look. "
    assert tool_calls.visible_auto("Let me look. <tool", final=False) == "Let me l"
    assert tool_calls.visible_auto("Let me look. <tool", final=True) == "Let me look. <tool"
    assert tool_calls.template_calls_tools("{% if tools %}<tool_call>{% endif %}")
    assert not tool_calls.template_calls_tools("{{ messages }}") and \
        not tool_calls.template_calls_tools(None)
