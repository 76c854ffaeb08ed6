"""One chat generation as the OpenAI APIs ask for it, shared by chat
completions and the Responses API: messages and tools validated, the tool
choice and response format turned into an output constraint the engine
enforces, the prompt tokenized (or continued token-exact within a session),
and the generated text turned back into an assistant message with parsed
tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flywheel.common.types import OutputConstraint
from flywheel.errors import InvalidArgument
from services.rollout.openai_api.constraints import json_value, structural
from services.rollout.serving.core import RolloutCore
from services.rollout.engine.base import SampleOutput
from services.rollout.serving.prompts import ChatPrompt, ResolvedPrompt, TokenPrompt, validate_messages, validate_tools
from services.rollout.openai_api.sessions import CallRecord, Session, continued_prompt
from services.rollout.openai_api.tool_calls import HermesFormat, tool_plan


@dataclass
class ChatTurn:
    prompt: ResolvedPrompt
    messages: list[dict[str, Any]]
    #: The tools the model was shown (None: none).
    tools: list[dict[str, Any]] | None
    #: Whether tool calls are parsed out of the reply (tools shown, and tool_choice not "none").
    parses_calls: bool
    #: Whether the output was constrained to tool calls.
    forced: bool
    constraint: OutputConstraint | None
    tool_format: HermesFormat


def response_format_constraint(fmt: Any, field: str) -> OutputConstraint | None:
    """OpenAI's response_format (chat) or text.format (responses) as a constraint; None for free text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidArgument(f"{field}: must be an object with a type")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return structural(json_value({"type": "object"}))
    if kind == "json_schema":
        # Chat nests the schema under "json_schema"; the Responses API puts it on the format itself.
        spec = fmt.get("json_schema", fmt)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            where = f"{field}.json_schema.schema" if "json_schema" in fmt else f"{field}.schema"
            raise InvalidArgument(f"{where}: must be a JSON schema object")
        return structural(json_value(schema))
    raise InvalidArgument(f"{field}.type: must be text, json_object or json_schema, got {kind!r}")


def prepare_turn(
    core: RolloutCore, *, messages: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None,
    response_format: OutputConstraint | None, session: Session | None, tool_format: HermesFormat,
    add_generation_prompt: bool = True, request_id: str = "", fields: dict[str, str] | None = None,
) -> ChatTurn:
    """Validates a chat request's parts; `fields` renames them in errors (the Responses API's names)."""
    name = {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
            "response_format": "response_format", **(fields or {})}
    engine, codec = core.require_engine()
    messages = validate_messages(messages, name["messages"])
    shown, forced = tool_plan(validate_tools(tools, name["tools"]), tool_choice, name["tool_choice"])
    constraint = response_format
    if forced is not None:
        if response_format is not None:
            raise InvalidArgument(f"{name['response_format']}: cannot be combined with a forced {name['tool_choice']}")
        constraint = tool_format.forced(forced, parallel=parallel_tool_calls is not False)
    if constraint is not None and not engine.supports_constraints:
        which = name["tool_choice"] if forced is not None else name["response_format"]
        raise InvalidArgument(f"{which}: the {engine.kind} engine cannot constrain what it samples "
                              "(structured output and forced tool calls); serve with engine.kind vllm")
    ids = continued_prompt(session, messages, shown, codec) if session is not None and add_generation_prompt else None
    if ids is not None:
        prompt = core.resolve(TokenPrompt(ids), "", request_id)
        prompt = ResolvedPrompt(prompt.ids, request_id, shown)
    else:
        prompt = core.resolve(ChatPrompt(messages, shown, add_generation_prompt), "", request_id)
    parses_calls = bool(shown) and tool_choice != "none"
    return ChatTurn(prompt, messages, shown, parses_calls, forced is not None, constraint, tool_format)


def reply_of(turn: ChatTurn, sample: SampleOutput) -> tuple[dict[str, Any], str]:
    """(the assistant message, its finish reason) of a finished sample: tool calls parsed when they may be called."""
    message: dict[str, Any] = {"role": "assistant", "content": sample.text}
    finish = sample.finish_reason
    if turn.parses_calls:
        content, calls = turn.tool_format.parse(sample.text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls" if finish == "stop" else finish
    return message, finish


def record(session: Session | None, api: str, turn: ChatTurn | None, prompt_ids: list[int], sample: SampleOutput,
           replica: str, reply: dict[str, Any] | None = None, response_id: str = "") -> None:
    """Adds a finished sample to the session's records (nothing without a session)."""
    if session is None:
        return
    session.calls.append(CallRecord(
        api=api, prompt_ids=list(prompt_ids), completion_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
        version_start=sample.version_start, version_end=sample.version_end, finish_reason=sample.finish_reason,
        text=sample.text, replica=replica, distribution=sample.distribution, messages=turn.messages if turn else None,
        tools=turn.tools if turn else None, reply=reply, response_id=response_id,
        version_spans=list(sample.version_spans), kept_sets=list(sample.kept_sets),
        routed_experts=sample.routed_experts,
    ))
