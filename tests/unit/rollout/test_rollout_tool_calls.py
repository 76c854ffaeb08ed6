"""Hermes-style tool calls in generated text become OpenAI tool_calls."""

from __future__ import annotations

import json

from services.rollout.openai_api.tool_calls import HermesFormat

parse_tool_calls = HermesFormat().parse
streamable_prefix = HermesFormat().streamable_prefix


def test_tool_calls_are_parsed_with_content_before_them() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2 * 3"}}\n</tool_call>' \
           '<tool_call>{"name": "clock", "arguments": "{}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["calc", "clock"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2 * 3"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_text_without_well_formed_calls_stays_content() -> None:
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


def test_streaming_holds_back_a_possible_marker() -> None:
    assert streamable_prefix("hello") == 5
    assert streamable_prefix("hello <tool") == 6
    assert streamable_prefix("hello <tool_call>{") == 6
    assert streamable_prefix("a < b") == 5
