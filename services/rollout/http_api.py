"""OpenAI-compatible HTTP API of the rollout service (FastAPI): routes,
bearer auth, error mapping. Translates JSON to the domain and back; streaming
bodies are in `http_stream`.

    GET  /v1/models            the served model (with its weight version)
    POST /v1/completions       text or token-id prompts; SSE when stream=true
    POST /v1/chat/completions  chat messages (+ tools); SSE when stream=true
    GET  /health               200 once a model is served (no auth)
    GET  /metrics              Prometheus text (no auth, like the metrics port)
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ValidationError

from flywheel.errors import FlywheelError, InvalidArgument, NotFound, Unauthenticated
from services.rollout import sampling
from services.rollout.config import RolloutConfig
from services.rollout.core import PromptOutput, QueueFull, RolloutCore
from services.rollout.http_stream import chat_stream, completion_stream
from services.rollout.openai_protocol import (
    ChatRequest, CompletionRequest, chat_logprobs, completion_logprobs, envelope, new_id, usage, version_of,
)
from services.rollout.prompts import ChatPrompt, PromptInput, TextPrompt, TokenPrompt
from services.rollout.tool_calls import parse_tool_calls

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 409, "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None, "code": status}}


def _error_response(exc: Exception) -> JSONResponse:
    code = getattr(exc, "code", "INTERNAL")
    status = HTTP_STATUS.get(code, 500)
    headers = {}
    if isinstance(exc, QueueFull):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_seconds)))
    return JSONResponse(error_body(status, str(exc)), status_code=status, headers=headers)


def _validation_message(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown parameter"
    return f"{where}: {err['msg']}"


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"body: not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"body: not valid JSON: {exc}") from None
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(_validation_message(exc)) from None
    unsupported = body.unsupported()
    if unsupported:
        raise InvalidArgument(f"{unsupported[0]}: not supported by this server")
    return body


def _completion_prompts(prompt: Any) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [TextPrompt(prompt)]
    if not prompt:
        raise InvalidArgument("prompt: empty prompt")
    if all(isinstance(p, int) for p in prompt):
        return [TokenPrompt(list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [TextPrompt(p) for p in prompt]
    return [TokenPrompt(list(p)) for p in prompt]


def create_app(core: RolloutCore, config: RolloutConfig, token: str | None) -> FastAPI:
    app = FastAPI(title="Flywheel rollout", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {token}".encode() if token else None
    limits = config.limits

    def authorize(request: Request) -> None:
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise Unauthenticated("missing or wrong bearer token")

    @app.exception_handler(FlywheelError)
    async def flywheel_error(request: Request, exc: FlywheelError) -> JSONResponse:
        return _error_response(exc)

    def check_model(name: str | None) -> None:
        if name and name != core.model_name:
            raise NotFound(f"model: {name!r} is not served here; this server serves {core.model_name!r}")

    @app.get("/health")
    async def health() -> JSONResponse:
        s = core.status()
        ok = core.engine is not None
        return JSONResponse({"status": "ok" if ok else "no model", "weight_version": s.version, "paused": s.paused},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    # The API routes are plain Starlette routes: FastAPI's per-request
    # machinery (dependency solving, response encoding) costs ~0.3 ms a call,
    # which on a small machine is taken from the engine; they parse and
    # answer JSON themselves anyway.
    async def models(request: Request) -> Response:
        authorize(request)
        s = core.status()
        return _json({"object": "list", "data": [{
            "id": core.model_name, "object": "model", "created": 0, "owned_by": "flywheel",
            "max_model_len": s.max_model_len, "weight_version": s.version,
        }]})

    async def completions(request: Request) -> Response:
        authorize(request)
        body: CompletionRequest = await _parse(request, CompletionRequest)
        check_model(body.model)
        inputs = _completion_prompts(body.prompt)
        spec = sampling.from_openai(body, max_top_logprobs=limits.max_top_logprobs, max_tokens=body.max_tokens,
                                    top_logprobs=body.logprobs or 0)
        many = len(inputs) > 1
        prompts = [core.resolve(p, f"prompt[{i}]" if many else "", body.request_id or "") for i, p in enumerate(inputs)]
        reservation = core.reserve(len(prompts) * spec.n)
        if body.stream:
            # The background task releases the reservation even if the body never ran.
            return StreamingResponse(completion_stream(core, body, prompts, spec, reservation),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        outputs = await core.generate(prompts, spec, reservation)
        return _json(_completion_body(core, body, outputs))

    async def chat(request: Request) -> Response:
        authorize(request)
        body: ChatRequest = await _parse(request, ChatRequest)
        check_model(body.model)
        tools = body.tools if body.tool_choice != "none" else None
        prompt = core.resolve(ChatPrompt(body.messages, tools, body.add_generation_prompt), "", body.request_id or "")
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs=true")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = core.status().max_model_len - len(prompt.ids)
        spec = sampling.from_openai(body, max_top_logprobs=limits.max_top_logprobs, max_tokens=max_tokens,
                                    top_logprobs=body.top_logprobs or 0)
        reservation = core.reserve(spec.n)
        if body.stream:
            return StreamingResponse(chat_stream(core, body, prompt, spec, reservation),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        (output,) = await core.generate([prompt], spec, reservation)
        return _json(_chat_body(core, body, output))

    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    return app


def _json(body: dict[str, Any]) -> Response:
    # Plain JSON types already: skips FastAPI's recursive jsonable_encoder.
    return Response(json.dumps(body, separators=(",", ":")).encode(), media_type="application/json")


def _completion_body(core: RolloutCore, body: CompletionRequest, outputs: list[PromptOutput]) -> dict[str, Any]:
    codec = core.codec
    choices, samples = [], []
    for p, output in enumerate(outputs):
        for s in output.samples:
            samples.append(s)
            choices.append({
                "index": p * len(output.samples) + s.index,
                "text": s.text,
                "logprobs": completion_logprobs(codec, s.token_ids, s.logprobs, s.top_logprobs) if body.logprobs is not None else None,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason or None,
                "prompt_token_ids": output.prompt_ids,
                "token_ids": s.token_ids,
                "weight_version": {"start": s.version_start, "end": s.version_end},
            })
    prompt_tokens = sum(len(o.prompt_ids) for o in outputs)
    return {
        **envelope("text_completion", new_id("cmpl"), core.model_name),
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(s.token_ids) for s in samples)),
        "prompt_token_ids": outputs[0].prompt_ids if len(outputs) == 1 else [o.prompt_ids for o in outputs],
        "weight_version": version_of(samples),
    }


def _chat_body(core: RolloutCore, body: ChatRequest, output: PromptOutput) -> dict[str, Any]:
    choices = []
    for s in output.samples:
        message: dict[str, Any] = {"role": "assistant", "content": s.text}
        finish = s.finish_reason
        if output_tools := body.tools if body.tool_choice != "none" else None:
            content, calls = parse_tool_calls(s.text) if output_tools else (s.text, [])
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choices.append({
            "index": s.index,
            "message": message,
            "logprobs": chat_logprobs(core.codec, s.token_ids, s.logprobs, s.top_logprobs) if body.logprobs else None,
            "finish_reason": finish,
            "stop_reason": s.stop_reason or None,
            "token_ids": s.token_ids,
            "weight_version": {"start": s.version_start, "end": s.version_end},
        })
    return {
        **envelope("chat.completion", new_id("chatcmpl"), core.model_name),
        "choices": choices,
        "usage": usage(len(output.prompt_ids), sum(len(s.token_ids) for s in output.samples)),
        "prompt_token_ids": output.prompt_ids,
        "weight_version": version_of(output.samples),
    }
