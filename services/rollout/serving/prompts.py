"""Prompts in their three forms (token ids, text, chat messages) and their
validation; every error names the offending field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.errors import InvalidArgument
from services.rollout.engine.text import TextCodec

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class TokenPrompt:
    ids: list[int]


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class ChatPrompt:
    #: Messages as OpenAI-style dicts (validated by `validate_messages`).
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


PromptInput = TokenPrompt | TextPrompt | ChatPrompt


@dataclass(frozen=True)
class ResolvedPrompt:
    """A prompt as the engine sees it."""

    ids: list[int]
    request_id: str = ""
    #: Chat prompts keep their tools: the answer may hold tool calls.
    tools: list[dict[str, Any]] | None = field(default=None)


def check_text(text: str, where: str) -> str:
    """Text must be valid Unicode: JSON escapes can smuggle in lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{where}: not valid UTF-8 (lone surrogate)") from None
    return text


def _content(value: Any, where: str) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, list):
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{where}[{i}]: only text content parts ({{type: text, text: ...}}) are supported")
            check_text(part["text"], f"{where}[{i}].text")
        return value
    raise InvalidArgument(f"{where}: must be a string or a list of text parts, got {type(value).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise InvalidArgument(f"{where}: must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidArgument(f"{where}.function.name: must be a non-empty string")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}.function.arguments: not valid JSON: {exc}") from None
    elif not isinstance(args, dict):
        raise InvalidArgument(f"{where}.function.arguments: must be a JSON string or an object")
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def validate_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Checks OpenAI-style chat messages; returns them normalised for the template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(f"{field}: must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}: must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        unknown = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if unknown:
            raise InvalidArgument(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        normalised: dict[str, Any] = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise InvalidArgument(f"{where}.tool_calls: only assistant messages make tool calls")
            if not isinstance(calls, list):
                raise InvalidArgument(f"{where}.tool_calls: must be a list")
            normalised["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif normalised["content"] is None:
            raise InvalidArgument(f"{where}.content: missing")
        for key in ("name", "tool_call_id"):
            if message.get(key):
                if not isinstance(message[key], str):
                    raise InvalidArgument(f"{where}.{key}: must be a string")
                normalised[key] = message[key]
        out.append(normalised)
    return out


def validate_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidArgument(f"{field}: must be a list of tool definitions")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"{field}[{i}].function.name: must be a non-empty string")
    return tools or None


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # the common case, in C
        return
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{field}[{j}]: token id {token} is outside the vocabulary [0, {vocab_size})")


def _at(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def resolve(
    prompt: PromptInput, codec: TextCodec, *, vocab_size: int, max_model_len: int, field: str, request_id: str = ""
) -> ResolvedPrompt:
    """Token ids of a prompt; InvalidArgument when empty, unknown ids or too long.

    `field` is the prompt's path in the request ("prompts[3]"), or "" when
    the prompt's parts are top-level fields (OpenAI's `prompt`, `messages`).
    """
    tools = None
    if isinstance(prompt, TokenPrompt):
        what = _at(field, "token_ids") if field else "prompt"
        ids = list(prompt.ids)
        check_token_ids(ids, vocab_size, what)
    elif isinstance(prompt, TextPrompt):
        what = _at(field, "text") if field else "prompt"
        if not prompt.text:
            raise InvalidArgument(f"{what}: empty prompt")
        check_text(prompt.text, what)
        ids = codec.encode(prompt.text, add_special_tokens=True)
    else:
        what = _at(field, "messages")
        messages = validate_messages(prompt.messages, what)
        tools = validate_tools(prompt.tools, _at(field, "tools"))
        ids = codec.encode_chat(messages, tools=tools, add_generation_prompt=prompt.add_generation_prompt, field=what)
    if not ids:
        raise InvalidArgument(f"{what}: empty prompt")
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            f"{what}: the prompt is {len(ids)} tokens; the model's context holds {max_model_len} "
            "(prompt and at least one completion token)"
        )
    return ResolvedPrompt(ids=ids, request_id=request_id, tools=tools)
