"""Tool calls in generated text: the Hermes `<tool_call>{json}</tool_call>`
blocks that the ChatML templates of Flywheel's models (and Qwen's) ask for,
turned into OpenAI `tool_calls`."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls or None, OpenAI tool_calls); no calls if any block is malformed."""
    calls = []
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        arguments = body.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": body["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


def streamable_prefix(text: str) -> int:
    """How much of `text` can be streamed as content: everything before a
    (possibly still partial) `<tool_call>` marker."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
