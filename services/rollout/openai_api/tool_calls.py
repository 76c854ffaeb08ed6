"""Tool calls in generated text, per model family, and the OpenAI shape of them.

A `ToolCallFormat` knows how one family writes calls: it parses them out of
generated text (into OpenAI `tool_calls`), says how much of a partial text is
plain content safe to stream, and builds the output constraint that forces a
call (`tool_choice` "required" or a named function) in that same format, so a
forced call is written exactly as the model writes calls by itself, and what
is trained on is the model's own format.

Formats (`engine.tool_parser`):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
  what the ChatML templates of Qwen, SmolLM2 and Flywheel's tiny models ask for.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from flywheel.common.types import OutputConstraint
from flywheel.errors import InvalidArgument
from services.rollout.openai_api.constraints import json_value, structural


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


class HermesFormat:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content before the calls or None, OpenAI tool_calls); no calls if any block is malformed."""
        calls = []
        for match in self._BLOCK.finditer(text):
            try:
                body = json.loads(match.group(1))
            except json.JSONDecodeError:
                return text, []
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                return text, []
            calls.append(_openai_call(body["name"], body.get("arguments", {})))
        if not calls:
            return text, []
        content = text[: text.index(self.OPEN)].strip()
        return content or None, calls

    def streamable_prefix(self, text: str) -> int:
        """How much of `text` can be streamed as content: everything before a
        (possibly still partial) `<tool_call>` marker."""
        at = text.find(self.OPEN)
        if at >= 0:
            return at
        for keep in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def forced(self, tools: list[dict[str, Any]], parallel: bool) -> OutputConstraint:
        """Output that is one call (or, with `parallel`, one or more) of one of `tools`, in this format:
        the call's JSON follows the tool's own parameter schema, so the arguments are valid, not just JSON."""
        calls = [{
            "type": "sequence", "elements": [
                {"type": "const_string", "value": f"{self.OPEN}\n"},
                json_value({
                    "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": tool["function"]["name"]},
                                   "arguments": tool["function"].get("parameters") or {"type": "object"}},
                }),
                {"type": "const_string", "value": f"\n{self.CLOSE}"},
            ],
        } for tool in tools]
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        fmt = {"type": "repeat", "content": one, "min": 1, "max": -1, "separator": "\n"} if parallel else one
        return structural(fmt)


TOOL_FORMATS = {"hermes": HermesFormat()}


def tool_format(name: str) -> HermesFormat:
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise InvalidArgument(f"engine.tool_parser: unknown format {name!r}; known: {', '.join(TOOL_FORMATS)}") from None


def tool_plan(tools: list[dict[str, Any]] | None, choice: Any,
              field: str) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """For an OpenAI `tool_choice`: (the tools the model is shown, the tools it must call one of, or None).

    "none" still shows the tools (as vLLM and OpenAI do: an agent's prompt stays the same from turn to
    turn, so a session continues token-exact and the prefix cache holds) but no call is parsed;
    "required" forces a call of any; a named choice forces that function."""
    if choice in (None, "auto", "none"):
        return tools, None
    if not tools:
        raise InvalidArgument(f"{field}: {json.dumps(choice)} needs tools")
    if choice == "required":
        return tools, tools
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        # Chat completions nest the name under "function"; the Responses API does not.
        name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(f'{field}: must be "none", "auto", "required" or {{"type": "function", ...name}}')
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise InvalidArgument(f"{field}: names function {name!r}, which is not among the tools")
    return tools, named
