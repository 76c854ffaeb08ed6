"""The OpenAI Responses API (`POST /v1/responses`) on top of chat generation.

A request becomes chat messages: `instructions` a system message, input
messages as they are, `function_call` items an assistant message's tool calls
and `function_call_output` items tool messages. `previous_response_id` is
resolved from the session's own records (the conversation that response
answered, plus its answer), so nothing is stored beyond a session's records;
outside a session it is refused. The answer becomes output items: a message
with its text, then one `function_call` item per parsed call. Streaming sends
the documented event sequence (created, output items and parts added, text
deltas, done events, completed).
"""

from __future__ import annotations

import json
import time
from typing import Any

from flywheel.errors import InvalidArgument
from services.rollout.engine.base import SampleOutput
from services.rollout.openai_api.openai_protocol import ResponsesRequest, new_id, sample_version
from services.rollout.openai_api.sessions import Session

_ROLES = ("user", "system", "developer", "assistant")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise InvalidArgument(f"{where}[{i}]: only text parts (input_text, output_text) are supported")
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{where}[{i}].text: must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"{where}: must be a string or a list of text parts")


def input_messages(items: str | list[Any], field: str = "input") -> list[dict[str, Any]]:
    """Responses input items as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidArgument(f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"{where}.name: must be a non-empty string")
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            # Parallel calls arrive as consecutive items: one assistant turn.
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output})
        elif kind == "reasoning":
            continue  # this server produces none; an agent may echo an empty one back
        else:
            raise InvalidArgument(f"{where}.type: {kind!r} is not supported (message, function_call, "
                                  "function_call_output)")
    if not messages:
        raise InvalidArgument(f"{field}: no messages")
    return messages


def chat_tools(tools: list[Any] | None, field: str = "tools") -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, parameters}) in chat's shape ({type, function: {...}})."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidArgument(f"{field}[{i}].type: only function tools are supported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def conversation(body: ResponsesRequest, session: Session | None) -> list[dict[str, Any]]:
    """The whole chat the request continues: the previous response's, then instructions and input."""
    messages: list[dict[str, Any]] = []
    if body.previous_response_id:
        if session is None:
            raise InvalidArgument("previous_response_id: needs a session endpoint (/sessions/{id}/v1); this server "
                                  "keeps no responses outside sessions, so send the whole input instead")
        previous = session.find_response(body.previous_response_id)
        assert previous.messages is not None and previous.reply is not None
        # Instructions are per request: the previous one's are not carried over.
        messages = [m for m in previous.messages if m.get("role") != "system"] + [previous.reply]
    new = input_messages(body.input)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    return messages + new


# -- the response object --------------------------------------------------------------------------------------------

def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'][5:]}", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def output_items(reply: dict[str, Any], message_id: str) -> list[dict[str, Any]]:
    items = []
    if reply.get("content"):
        items.append(_message_item(message_id, reply["content"]))
    items += [_call_item(c) for c in reply.get("tool_calls", ())]
    if not items:
        items.append(_message_item(message_id, ""))
    return items


def response_object(body: ResponsesRequest, response_id: str, model: str, *, status: str,
                    output: list[dict[str, Any]], sample: SampleOutput | None = None,
                    prompt_tokens: int = 0, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    incomplete = None
    if sample is not None and sample.finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    out: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "store": bool(body.store), "usage": None,
    }
    if sample is not None:
        out["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": len(sample.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": prompt_tokens + len(sample.token_ids)}
        # Flywheel's extensions, as in chat completions.
        out["prompt_token_ids"] = prompt_ids
        out["token_ids"] = sample.token_ids
        out["weight_version"] = sample_version(sample)
    return out


class ResponseEvents:
    """The server-sent events of one streamed response, numbered in order."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.body, self.response_id, self.model = body, response_id, model
        self.message_id = new_id("msg")
        self._sequence = 0
        self._text_open = False

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def start(self, prompt_ids: list[int]) -> list[str]:
        shell = response_object(self.body, self.response_id, self.model, status="in_progress", output=[])
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _open_text(self) -> list[str]:
        if self._text_open:
            return []
        self._text_open = True
        return [
            self._event("response.output_item.added", output_index=0,
                        item=_message_item(self.message_id, "", "in_progress")),
            self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []}),
        ]

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        return [*self._open_text(), self._event("response.output_text.delta", item_id=self.message_id,
                                                 output_index=0, content_index=0, delta=delta, logprobs=[])]

    def finish(self, reply: dict[str, Any], sample: SampleOutput, prompt_ids: list[int]) -> list[str]:
        events = []
        output = output_items(reply, self.message_id)
        index = 0
        for item in output:
            if item["type"] == "message":
                part = item["content"][0]
                # The caller streamed all content through text() already; an empty answer opens here.
                events += self._open_text()
                events.append(self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                                          content_index=0, text=part["text"], logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                                          content_index=0, part=part))
            else:
                events.append(self._event("response.output_item.added", output_index=index,
                                          item={**item, "arguments": "", "status": "in_progress"}))
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=item["arguments"]))
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
            index += 1
        done = response_object(self.body, self.response_id, self.model, status="completed", output=output,
                               sample=sample, prompt_tokens=len(prompt_ids), prompt_ids=prompt_ids)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=done))
        return events

    def error(self, exc: BaseException) -> list[str]:
        code = getattr(exc, "code", "INTERNAL")
        return [self._event("error", code=code, message=str(exc), param=None)]
