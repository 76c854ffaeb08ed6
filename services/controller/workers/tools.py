"""Tools an agent may call: registration, call parsing and execution.

A tool is a Python function, sync or async, called with the model's JSON
arguments as keyword arguments; its return value (text, or anything JSON
can encode) is what the model sees next. A tool that raises, an unknown
tool name or malformed call JSON become an "error: ..." result the model
sees: the environment's answer, not a crash of the run.

Calls are written the Hermes/Qwen way:
`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    #: Set when the call could not be parsed; the model is told why.
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"tool call is not valid JSON: {exc.msg}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "tool call arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolRegistry:
    def __init__(self, timeout_seconds: float = 60.0) -> None:
        self.tools: dict[str, Tool] = {}
        self.timeout_seconds = timeout_seconds

    def register(self, name: str, fn: Callable[..., Any], description: str = "", parameters: dict | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"tool {name!r} is not callable")
        self.tools[name] = Tool(name, fn, description, parameters or {"type": "object", "properties": {}})

    def __len__(self) -> int:
        return len(self.tools)

    def system_prompt(self) -> str:
        """Tells the model which tools exist and how to call them."""
        specs = "\n".join(json.dumps(t.spec()) for t in self.tools.values())
        return (
            "You may call these tools:\n"
            f"{specs}\n"
            'To call one, write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>; '
            "its result comes back in the next message."
        )

    async def call(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}"
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await asyncio.wait_for(tool.fn(**call.arguments), self.timeout_seconds)
            else:
                # A thread, so a slow tool does not stall every other rollout.
                result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), self.timeout_seconds)
        except TimeoutError:
            return f"error: tool {call.name} timed out after {self.timeout_seconds:g}s"
        except Exception as exc:  # user code: report to the model, keep the episode going
            return f"error: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result)
