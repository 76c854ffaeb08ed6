"""The Anthropic Messages dialect (`POST /v1/messages`) on top of chat generation.

A request becomes chat messages: `system` a system message; a user turn's
text blocks a user message and its `tool_result` blocks tool messages (before
the text, as the chat template expects a tool's answer right after the call);
an assistant turn's text and `tool_use` blocks an assistant message with tool
calls. `tools` ({name, description, input_schema}) become function tools and
`tool_choice` auto / any / tool / none the chat API's auto / required / named
/ none. The answer becomes content blocks: its text, then one `tool_use`
block per parsed call, with `stop_reason` end_turn, max_tokens,
stop_sequence or tool_use.

Flywheel's extensions, as on the other surfaces: `prompt_token_ids`,
`token_ids` and `weight_version` {start, end, spans} on the message (in a stream:
`prompt_token_ids` on message_start's message, `token_ids` and
`weight_version` on message_delta). Errors have this API's shape:
{"type": "error", "error": {"type": ..., "message": ...}}.

`output_config.format` (a JSON schema) constrains the answer as chat's
response_format does. The sampling parameters the Messages API had before
its SDK dropped them (temperature, top_p, top_k) are still accepted, for
agents that send them. What this server cannot do is refused (400), never
ignored: images and documents, server tools, extended thinking, effort.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.errors import InvalidArgument
from services.rollout.engine.base import SampleOutput
from services.rollout.openai_api.openai_protocol import sample_version

#: Anthropic's error types by HTTP status (its documented set; 529 is "overloaded").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 410: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


class MessagesRequest(BaseModel):
    """POST /v1/messages; unknown parameters and wrong JSON types are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Any]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    #: {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}; "disable_parallel_tool_use" on any of them.
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    #: {"format": {"type": "json_schema", "schema": ...}}: structured output (an engine that constrains
    #: output: vLLM); an "effort" other than none is refused.
    output_config: dict[str, Any] | None = None
    #: Accepted when disabled; this server does not think before it answers.
    thinking: dict[str, Any] | None = None
    #: A prompt-caching hint: accepted, and needless (the engine's prefix cache works without it).
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Flywheel's extensions, as in chat completions.
    seed: int | None = None
    request_id: str | None = None

    def unsupported(self) -> list[str]:
        bad = ["thinking"] if self.thinking and self.thinking.get("type") != "disabled" else []
        if (self.output_config or {}).get("effort") is not None:
            bad.append("output_config.effort")
        return bad


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what a Messages request would send to the model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        return ["thinking"] if self.thinking and self.thinking.get("type") != "disabled" else []


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


# -- request -> chat ------------------------------------------------------------------------------------------------

def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}: must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidArgument(f"{where}[{i}].type: only text blocks are supported here, got {kind!r}")
        if not isinstance(block.get("text"), str):
            raise InvalidArgument(f"{where}[{i}].text: must be a string")
        parts.append(block["text"])
    return "".join(parts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise InvalidArgument(f"{where}: must be a string or a list of content blocks")
    return content


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    texts = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text([block], where))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise InvalidArgument(f"{where}[{i}].tool_use_id: must be a non-empty string")
            result = _text(block.get("content", ""), f"{where}[{i}].content")
            # The model reads an error as text: say so, as the result alone would not.
            if block.get("is_error"):
                result = f"Error: {result}"
            messages.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        else:
            raise InvalidArgument(f"{where}[{i}].type: {kind!r} is not supported (text, tool_result)")
    if texts:
        messages.append({"role": "user", "content": "".join(texts)})
    return messages


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    texts, calls = [], []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text([block], where))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"{where}[{i}].name: must be a non-empty string")
            if not isinstance(arguments, dict):
                raise InvalidArgument(f"{where}[{i}].input: must be an object")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # this server produces none; an agent may echo one back
        else:
            raise InvalidArgument(f"{where}[{i}].type: {kind!r} is not supported (text, tool_use)")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """A Messages request's conversation as chat messages."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}: must be an object")
        role = message.get("role")
        if role == "user":
            out += _user_turn(message.get("content"), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_turn(message.get("content"), f"{where}.content"))
        else:
            raise InvalidArgument(f"{where}.role: must be user or assistant, got {role!r}")
    if len(out) == (1 if system else 0):
        raise InvalidArgument("messages: no messages")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Custom tools ({name, description, input_schema}) as chat function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise InvalidArgument(f"tools[{i}].type: only custom tools (name, input_schema) are supported, got {kind!r}")
        if not isinstance(tool.get("input_schema"), dict):
            raise InvalidArgument(f"tools[{i}].input_schema: must be a JSON schema object")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(the chat API's tool_choice, its parallel_tool_calls) of a Messages tool_choice."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidArgument("tool_choice.name: must name a tool")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidArgument(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")


# -- the answer -----------------------------------------------------------------------------------------------------

def tool_use_id(call_id: str) -> str:
    """Anthropic's id spelling of a parsed call's id (the same id, so a reply sent back matches)."""
    return f"toolu_{call_id.removeprefix('call_')}"


def content_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant chat message as Messages content blocks: its text (if any), then its tool calls."""
    blocks: list[dict[str, Any]] = []
    if reply.get("content"):
        blocks.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls", ()):
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                       "input": json.loads(fn["arguments"])})
    return blocks


def stop_of(sample: SampleOutput, reply: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished sample whose finish reason is stop or length."""
    if reply.get("tool_calls"):
        return "tool_use", None
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.stop_reason and sample.stop_reason in (stop_sequences or ()):
        return "stop_sequence", sample.stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def message_object(message_id: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                   prompt_ids: list[int], sample: SampleOutput | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop[0], "stop_sequence": stop[1],
        "usage": usage(len(prompt_ids), len(sample.token_ids) if sample is not None else 0),
        # Flywheel's extensions, as in chat completions.
        "prompt_token_ids": prompt_ids,
    }
    if sample is not None:
        out["token_ids"] = sample.token_ids
        out["weight_version"] = sample_version(sample)
    return out
