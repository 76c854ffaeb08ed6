"""OpenAI-compatible HTTP API of the rollout service (FastAPI): routes,
bearer auth, error mapping. Translates JSON to the domain and back; streaming
bodies are in `http_stream`.

    GET  /v1/models            the served model (with its weight version)
    POST /v1/completions       text or token-id prompts; SSE when stream=true
    POST /v1/chat/completions  chat messages, tools, structured output; SSE when stream=true
    POST /v1/responses         the Responses API (services.rollout.openai_api.http_responses)
    POST /v1/messages          the Anthropic Messages dialect, and /v1/messages/count_tokens
                               (services.rollout.openai_api.http_messages; errors in that API's shape)
    GET  /health               200 once a model is served (no auth)
    GET  /openapi.json         the OpenAPI document of every route here (no auth; services.rollout.openai_api.openapi)
    GET  /metrics              Prometheus text (a token of any scope with server.metrics_auth, like the metrics port)

Agent sessions (services.rollout.openai_api.sessions): the same API routes under
`/sessions/{id}/v1/`, authorized by that session's key and recorded
token-exact, plus `POST /sessions/{id}/v1/finish` ({"reward": x}) for the
agent; `POST /v1/sessions`, `GET` and `DELETE /v1/sessions/{id}` for the
controller (service token).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from flywheel.errors import InvalidArgument, NotFound
from flywheel.runtime.auth import Scope, TokenScopes
from services.rollout.serving import sampling
from services.rollout.openai_api.chat import ChatTurn, prepare_turn, record, reply_of, response_format_constraint
from services.rollout.config import RolloutConfig
from services.rollout.serving.core import PromptOutput, RolloutCore
from services.rollout.openai_api.http_common import install_error_handlers, json_response, parse
from services.rollout.openai_api.http_messages import messages_routes
from services.rollout.openai_api.http_responses import responses_route
from services.rollout.openai_api.http_stream import chat_stream, completion_stream
from services.rollout.openai_api.openapi import openapi_document
from services.rollout.openai_api.openai_protocol import (
    ChatRequest, CompletionRequest, FinishSessionRequest, OpenSessionRequest, chat_logprobs, completion_logprobs, envelope, new_id, sample_version, usage, version_of,
)
from services.rollout.serving.prompts import PromptInput, TextPrompt, TokenPrompt
from services.rollout.openai_api.sessions import Session, SessionStore, pace
from services.rollout.openai_api.tool_calls import tool_format

#: Every route of this API is for agents (generation, tokenize, sessions); larger scopes may call them too.
API_SCOPE = Scope.AGENT


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


def create_app(core: RolloutCore, config: RolloutConfig, tokens: TokenScopes, sessions: SessionStore,
               replica: str) -> FastAPI:
    """`tokens`: the bearer tokens accepted, by scope (none: auth off); `replica`: this rollout's name
    in session records (its synchronizer component id)."""
    app = FastAPI(title="Flywheel rollout", docs_url=None, redoc_url=None, openapi_url=None)
    limits = config.limits
    tools_format = tool_format(config.engine.tool_parser)

    def authorize(request: Request) -> Session | None:
        """The session of a session-scoped route (its key checked), else the bearer token's scope checked."""
        session_id = request.path_params.get("session_id")
        # The Anthropic SDK sends its key as x-api-key (its auth_token option as a bearer token).
        bearer = request.headers.get("authorization") or (
            f"Bearer {request.headers['x-api-key']}" if "x-api-key" in request.headers else None)
        if session_id is not None:
            return sessions.authorize(session_id, bearer or "")
        if tokens:
            tokens.admit(bearer, API_SCOPE, f"{request.method} {request.url.path}")
        return None

    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name and name != core.model_name:
            raise NotFound(f"model: {name!r} is not served here; this server serves {core.model_name!r}")

    def one_choice(session: Session | None, n: int | None) -> None:
        if session is not None and (n or 1) != 1:
            raise InvalidArgument(f"n: a session records one answer per call; got n={n}")

    @app.get("/health")
    async def health() -> JSONResponse:
        s = core.status()
        ok = core.engine is not None
        return JSONResponse({"status": "ok" if ok else "no model", "weight_version": s.version, "paused": s.paused},
                            status_code=200 if ok else 503)

    document = openapi_document(metrics_auth=config.server.metrics_auth)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return json_response(document)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if config.server.metrics_auth:  # as the metrics port: any scope's token
            authorize(request)
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    # The API routes are plain Starlette routes: FastAPI's per-request
    # machinery (dependency solving, response encoding) costs ~0.3 ms a call,
    # which on a small machine is taken from the engine; they parse and
    # answer JSON themselves anyway.
    async def models(request: Request) -> Response:
        authorize(request)
        s = core.status()
        return json_response({"object": "list", "data": [{
            "id": core.model_name, "object": "model", "created": 0, "owned_by": "flywheel",
            "max_model_len": s.max_model_len, "weight_version": s.version,
        }]})

    async def completions(request: Request) -> Response:
        session = authorize(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        check_model(body.model)
        one_choice(session, body.n)
        inputs = _completion_prompts(body.prompt)
        if session is not None and len(inputs) > 1:
            raise InvalidArgument("prompt: a session records one prompt per call")
        spec = sampling.from_openai(body, max_top_logprobs=limits.max_top_logprobs, max_tokens=body.max_tokens,
                                    top_logprobs=body.logprobs or 0)
        many = len(inputs) > 1
        prompts = [core.resolve(p, f"prompt[{i}]" if many else "", body.request_id or "") for i, p in enumerate(inputs)]
        reservation = core.reserve(len(prompts) * spec.n)

        def on_final(prompt_ids: list[int], sample: Any) -> None:
            record(session, "completions", None, prompt_ids, sample, replica)

        if body.stream:
            # The background task releases the reservation even if the body never ran.
            return StreamingResponse(completion_stream(core, body, prompts, spec, reservation, on_final, pace(session)),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        outputs = await core.generate(prompts, spec, reservation, **pace(session))
        for output in outputs:
            for sample in output.samples:
                on_final(output.prompt_ids, sample)
        return json_response(_completion_body(core, body, outputs))

    async def chat(request: Request) -> Response:
        session = authorize(request)
        body: ChatRequest = await parse(request, ChatRequest)
        check_model(body.model)
        one_choice(session, body.n)
        turn = prepare_turn(
            core, messages=body.messages, tools=body.tools, tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls, session=session, tool_format=tools_format,
            response_format=response_format_constraint(body.response_format, "response_format"),
            add_generation_prompt=body.add_generation_prompt, request_id=body.request_id or "",
        )
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs=true")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = core.status().max_model_len - len(turn.prompt.ids)
        spec = sampling.from_openai(body, max_top_logprobs=limits.max_top_logprobs, max_tokens=max_tokens,
                                    top_logprobs=body.top_logprobs or 0, constraint=turn.constraint)
        reservation = core.reserve(spec.n)

        def on_final(sample: Any, reply: dict[str, Any]) -> None:
            record(session, "chat.completions", turn, turn.prompt.ids, sample, replica, reply)

        if body.stream:
            return StreamingResponse(chat_stream(core, body, turn, spec, reservation, on_final, pace(session)),
                                     media_type="text/event-stream", background=BackgroundTask(reservation.release))
        (output,) = await core.generate([turn.prompt], spec, reservation, **pace(session))
        return json_response(_chat_body(core, body, turn, output, on_final))

    async def open_session(request: Request) -> Response:
        authorize(request)
        body: OpenSessionRequest = await parse(request, OpenSessionRequest, may_be_empty=True)
        session = sessions.open(body.ttl_seconds, body.metadata)
        return json_response({"id": session.id, "key": session.key, "base_path": f"/sessions/{session.id}/v1",
                      "expires_in": session.ttl_seconds})

    async def get_session(request: Request) -> Response:
        authorize(request)
        return json_response(sessions.get(request.path_params["id"]).to_json())

    async def delete_session(request: Request) -> Response:
        authorize(request)
        sessions.delete(request.path_params["id"])
        return json_response({"id": request.path_params["id"], "deleted": True})

    async def finish_session(request: Request) -> Response:
        session = authorize(request)
        assert session is not None
        body: FinishSessionRequest = await parse(request, FinishSessionRequest, may_be_empty=True)
        return json_response(sessions.finish(session.id, body.reward).to_json())

    responses = responses_route(core, config, authorize, check_model, tools_format, replica)
    messages, count_tokens = messages_routes(core, config, authorize, check_model, tools_format, replica)
    for prefix in ("/v1", "/sessions/{session_id}/v1"):
        app.add_route(f"{prefix}/models", models, methods=["GET"])
        app.add_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_route(f"{prefix}/responses", responses, methods=["POST"])
        app.add_route(f"{prefix}/messages", messages, methods=["POST"])
        app.add_route(f"{prefix}/messages/count_tokens", count_tokens, methods=["POST"])
    app.add_route("/sessions/{session_id}/v1/finish", finish_session, methods=["POST"])
    app.add_route("/v1/sessions", open_session, methods=["POST"])
    app.add_route("/v1/sessions/{id}", get_session, methods=["GET"])
    app.add_route("/v1/sessions/{id}", delete_session, methods=["DELETE"])
    return app


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
                "weight_version": sample_version(s),
            })
    prompt_tokens = sum(len(o.prompt_ids) for o in outputs)
    return {
        **envelope("text_completion", new_id("cmpl"), core.model_name),
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(s.token_ids) for s in samples)),
        "prompt_token_ids": outputs[0].prompt_ids if len(outputs) == 1 else [o.prompt_ids for o in outputs],
        "weight_version": version_of(samples),
    }


def _chat_body(core: RolloutCore, body: ChatRequest, turn: ChatTurn, output: PromptOutput,
               on_final: Any) -> dict[str, Any]:
    choices = []
    for s in output.samples:
        message, finish = reply_of(turn, s)
        on_final(s, message)
        choices.append({
            "index": s.index,
            "message": message,
            "logprobs": chat_logprobs(core.codec, s.token_ids, s.logprobs, s.top_logprobs) if body.logprobs else None,
            "finish_reason": finish,
            "stop_reason": s.stop_reason or None,
            "token_ids": s.token_ids,
            "weight_version": sample_version(s),
        })
    return {
        **envelope("chat.completion", new_id("chatcmpl"), core.model_name),
        "choices": choices,
        "usage": usage(len(output.prompt_ids), sum(len(s.token_ids) for s in output.samples)),
        "prompt_token_ids": output.prompt_ids,
        "weight_version": version_of(output.samples),
    }
