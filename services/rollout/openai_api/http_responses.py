"""The `/v1/responses` route (plain and session-scoped): the request turned
into a chat turn (services.rollout.openai_api.responses_api), generated like a chat
completion, answered as a response object or its event stream."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from services.rollout.serving import sampling
from services.rollout.openai_api.chat import prepare_turn, record, reply_of, response_format_constraint
from services.rollout.config import RolloutConfig
from services.rollout.serving.core import RolloutCore
from services.rollout.openai_api.http_common import json_response, parse
from services.rollout.openai_api.http_stream import turn_stream
from services.rollout.openai_api.openai_protocol import ResponsesRequest, new_id
from services.rollout.openai_api.responses_api import ResponseEvents, chat_tools, conversation, output_items, response_object
from services.rollout.openai_api.sessions import Session, pace
from services.rollout.openai_api.tool_calls import HermesFormat

#: How the Responses API names the parts of a chat request, in error messages.
_FIELDS = {"messages": "input", "response_format": "text.format"}


def responses_route(
    core: RolloutCore, config: RolloutConfig, authorize: Callable[[Request], Session | None],
    check_model: Callable[[str | None], None], tool_format: HermesFormat, replica: str,
) -> Callable[[Request], Awaitable[Response]]:
    async def responses(request: Request) -> Response:
        session = authorize(request)
        body: ResponsesRequest = await parse(request, ResponsesRequest)
        check_model(body.model)
        turn = prepare_turn(
            core, messages=conversation(body, session), tools=chat_tools(body.tools), tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls, session=session, tool_format=tool_format,
            response_format=response_format_constraint((body.text or {}).get("format"), "text.format"),
            request_id=body.request_id or "", fields=_FIELDS,
        )
        max_tokens = body.max_output_tokens or core.status().max_model_len - len(turn.prompt.ids)
        spec = sampling.make_spec(
            field="", max_top_logprobs=config.limits.max_top_logprobs, max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or -1, seed=body.seed,
            constraint=turn.constraint,
        )
        response_id = new_id("resp")
        reservation = core.reserve(1)

        def finished(sample: Any) -> dict[str, Any]:
            reply, _ = reply_of(turn, sample)
            record(session, "responses", turn, turn.prompt.ids, sample, replica, reply, response_id)
            return reply

        if body.stream:
            events = ResponseEvents(body, response_id, core.model_name)
            return StreamingResponse(turn_stream(core, turn, spec, reservation, events, finished, pace(session)),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        (output,) = await core.generate([turn.prompt], spec, reservation, **pace(session))
        sample = output.samples[0]
        return json_response(response_object(
            body, response_id, core.model_name, status="completed", output=output_items(finished(sample), new_id("msg")),
            sample=sample, prompt_tokens=len(output.prompt_ids), prompt_ids=output.prompt_ids,
        ))

    return responses
