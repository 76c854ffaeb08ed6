"""The `/v1/messages` routes (plain and session-scoped): the Anthropic
Messages dialect (services.rollout.openai_api.messages_api) turned into a
chat turn, generated like a chat completion, answered as a message or its
event stream; `/v1/messages/count_tokens` counts a request's prompt. Every
error, before or during a stream, has that API's shape.

A stream sends Anthropic's event sequence: message_start (with Flywheel's
`prompt_token_ids`), ping, per content block its start, deltas (text_delta,
or one input_json_delta with a tool call's whole input) and stop, then
message_delta (stop reason, usage, and Flywheel's `token_ids` and
`weight_version`) and message_stop. Text from a tool-call marker on is held
back until the call is parsed, as in chat completions.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from flywheel.errors import FlywheelError
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import SampleOutput
from services.rollout.openai_api.chat import ChatTurn, prepare_turn, record, reply_of, response_format_constraint
from services.rollout.openai_api.http_common import error_status, json_response, parse
from services.rollout.openai_api.http_stream import turn_stream
from services.rollout.openai_api.messages_api import (
    CountTokensRequest, MessagesRequest, chat_messages, chat_tool_choice, chat_tools, content_blocks, error_body,
    message_object, stop_of,
)
from services.rollout.openai_api.openai_protocol import sample_version
from services.rollout.openai_api.sessions import Session, pace
from services.rollout.openai_api.tool_calls import HermesFormat
from services.rollout.serving import sampling
from services.rollout.serving.core import RolloutCore

log = logging.getLogger(__name__)

Route = Callable[[Request], Awaitable[Response]]

#: What a finished sample that did not end normally is answered with: an aborted one (a weight update in
#: abort mode) as overloaded, which the SDK retries; an engine error as an API error.
_UNFINISHED = {"abort": (529, "the generation was aborted by a weight update (pause mode abort); retry"),
               "error": (500, "the engine failed this generation")}


class _Unfinished(FlywheelError):
    def __init__(self, reason: str) -> None:
        self.http_status, message = _UNFINISHED.get(reason, (500, f"the generation ended with {reason!r}"))
        super().__init__(message)


def anthropic_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, FlywheelError):
        status, headers = error_status(exc)
        message = str(exc)
    else:  # a bug: logged with its traceback, answered without it
        log.exception("messages route failed")
        status, headers, message = 500, {}, f"internal error: {type(exc).__name__}"
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def _in_anthropic_shape(route: Route) -> Route:
    async def answered(request: Request) -> Response:
        try:
            return await route(request)
        except Exception as exc:  # noqa: BLE001 - every failure answered in the dialect's shape
            return anthropic_error(exc)

    return answered


def messages_routes(
    core: RolloutCore, config: RolloutConfig, authorize: Callable[[Request], Session | None],
    check_model: Callable[[str | None], None], tool_format: HermesFormat, replica: str,
) -> tuple[Route, Route]:
    """(POST /v1/messages, POST /v1/messages/count_tokens)."""

    def turn_of(body: MessagesRequest | CountTokensRequest, session: Session | None) -> ChatTurn:
        check_model(body.model)
        choice, parallel = chat_tool_choice(body.tool_choice)
        return prepare_turn(
            core, messages=chat_messages(body.system, body.messages), tools=chat_tools(body.tools),
            tool_choice=choice, parallel_tool_calls=parallel, session=session, tool_format=tool_format,
            response_format=response_format_constraint(getattr(body, "output_config", None) and
                                                       body.output_config.get("format"), "output_config.format"),
            request_id=getattr(body, "request_id", None) or "",
        )

    async def messages(request: Request) -> Response:
        session = authorize(request)
        body: MessagesRequest = await parse(request, MessagesRequest)
        turn = turn_of(body, session)
        spec = sampling.make_spec(
            field="", max_top_logprobs=config.limits.max_top_logprobs, max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or -1, seed=body.seed,
            stop=body.stop_sequences or (), constraint=turn.constraint,
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        reservation = core.reserve(1)

        def finished(sample: SampleOutput) -> dict[str, Any]:
            if sample.finish_reason not in ("stop", "length"):
                raise _Unfinished(sample.finish_reason)
            reply, _ = reply_of(turn, sample)
            record(session, "messages", turn, turn.prompt.ids, sample, replica, reply)
            return reply

        if body.stream:
            events = MessageEvents(message_id, core.model_name, body.stop_sequences)
            return StreamingResponse(turn_stream(core, turn, spec, reservation, events, finished, pace(session)),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        (output,) = await core.generate([turn.prompt], spec, reservation, **pace(session))
        sample = output.samples[0]
        reply = finished(sample)
        return json_response(message_object(message_id, core.model_name, content_blocks(reply),
                                            stop_of(sample, reply, body.stop_sequences), output.prompt_ids, sample))

    async def count_tokens(request: Request) -> Response:
        session = authorize(request)
        body: CountTokensRequest = await parse(request, CountTokensRequest)
        return json_response({"input_tokens": len(turn_of(body, session).prompt.ids)})

    return _in_anthropic_shape(messages), _in_anthropic_shape(count_tokens)


class MessageEvents:
    """The server-sent events of one streamed message, in Anthropic's order."""

    def __init__(self, message_id: str, model: str, stop_sequences: list[str] | None) -> None:
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self._blocks = 0  # content blocks opened so far
        self._text_open = False

    @staticmethod
    def _event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"

    def start(self, prompt_ids: list[int]) -> list[str]:
        shell = message_object(self.message_id, self.model, [], (None, None), prompt_ids, None)
        return [self._event("message_start", message=shell), self._event("ping")]

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        if not self._text_open:
            self._text_open = True
            events.append(self._event("content_block_start", index=self._blocks,
                                      content_block={"type": "text", "text": ""}))
            self._blocks += 1
        events.append(self._event("content_block_delta", index=self._blocks - 1,
                                  delta={"type": "text_delta", "text": delta}))
        return events

    def finish(self, reply: dict[str, Any], sample: SampleOutput, prompt_ids: list[int]) -> list[str]:
        events = []
        blocks = content_blocks(reply)
        if self._text_open:
            events.append(self._event("content_block_stop", index=self._blocks - 1))
        elif not blocks:  # an empty answer is one empty text block, as Anthropic sends it
            events += [self._event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                       self._event("content_block_stop", index=0)]
            self._blocks = 1
        for block in blocks:
            if block["type"] != "tool_use":
                continue
            index, self._blocks = self._blocks, self._blocks + 1
            events += [
                self._event("content_block_start", index=index, content_block={**block, "input": {}}),
                self._event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}),
                self._event("content_block_stop", index=index),
            ]
        stop_reason, stop_sequence = stop_of(sample, reply, self.stop_sequences)
        events.append(self._event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage={"output_tokens": len(sample.token_ids)},
            # Flywheel's extensions, as on the message itself.
            token_ids=sample.token_ids, weight_version=sample_version(sample),
        ))
        events.append(self._event("message_stop"))
        return events

    def error(self, exc: BaseException) -> list[str]:
        if isinstance(exc, FlywheelError):
            status, message = error_status(exc)[0], str(exc)
        else:
            log.error("messages stream failed", exc_info=exc)
            status, message = 500, f"internal error: {type(exc).__name__}"
        return [self._event("error", error=error_body(status, message)["error"])]
