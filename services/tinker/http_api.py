"""The Tinker API's HTTP routes (those SDK `tinker==0.38` calls), translated to
the gateway's calls (services/tinker/gateway.py).

Auth: the SDK sends its key as `X-API-Key`; it is one of our scoped tokens
(flywheel.runtime.auth), and training needs the service scope. The SDK only
sends keys that start with `tml-`, so the tokens handed to it must (the
tokens file's `tinker` entry: `python -m flywheel.runtime.tokens init`).

A call this gateway does not serve answers 404 naming it, never an empty
success; a malformed body answers 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flywheel.errors import HTTP_STATUS, FlywheelError, InvalidArgument
from flywheel.runtime.auth import Scope, TokenScopes
from services.tinker import metrics
from services.tinker.gateway import Gateway
from services.tinker.wire import parse_forward_backward

PROTOBUF = "application/x-protobuf"
#: What a training client may do; the health check needs no key.
TRAIN_SCOPE = Scope.SERVICE
#: A forward_backward body's bound after zstd is undone (the SDK's chunks are 5 MB at most).
MAX_BODY_BYTES = 256 * 1024 * 1024


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise InvalidArgument(f"{request.url.path}: the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"{request.url.path}: the body must be a JSON object")
    return body


def create_app(gateway: Gateway, tokens: TokenScopes) -> FastAPI:
    app = FastAPI(title="Flywheel Tinker gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(FlywheelError)
    async def domain_error(request: Request, exc: FlywheelError) -> JSONResponse:
        return _error(HTTP_STATUS.get(exc.code, 500), str(exc))

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        what = "is not served by this gateway" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, f"{request.method} {request.url.path} {what}")

    metrics.SESSIONS.set_function(gateway.sessions.running)

    @app.middleware("http")
    async def authorize_and_count(request: Request, call_next):
        response = await _authorized(request, call_next)
        route = request.scope.get("route")
        metrics.REQUESTS.labels(getattr(route, "path", "unknown"), str(response.status_code)).inc()
        return response

    async def _authorized(request: Request, call_next):
        if tokens and request.url.path != "/api/v1/healthz":
            key = request.headers.get("x-api-key")
            try:
                tokens.admit(f"Bearer {key}" if key else None, TRAIN_SCOPE, f"{request.method} {request.url.path}")
            except FlywheelError as exc:
                return _error(HTTP_STATUS[exc.code], str(exc))
        return await call_next(request)

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        # The flags this server's behaviour depends on, stated rather than left to the SDK's defaults.
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return {"sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return gateway.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        await _json(request)  # tags, user_metadata and sdk_version: nothing here depends on them
        return {"type": "create_session", "session_id": gateway.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> Response:
        body = await _json(request)
        try:
            gateway.sessions.heartbeat(str(body.get("session_id", "")))
        except FlywheelError as exc:  # 410 tells the SDK to stop beating
            return _error(410, str(exc))
        return JSONResponse({"type": "session_heartbeat"})

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Response:
        body = await _json(request)
        reason = body.get("reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind not in ("success", "errored", "interrupted"):
            raise InvalidArgument(f"reason.type must be success, errored or interrupted, got {kind!r}")
        gateway.finish_session(session_id, kind, body.get("detail"))
        return Response(status_code=200, content=b"null", media_type="application/json")

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}  # the SDK's client-side events: not collected here

    # The calls whose body is a JSON object, answered by the gateway method of the same name.
    def json_call(call):
        async def route(request: Request) -> dict:
            return call(await _json(request))
        return route

    for name in ("create_model", "get_info", "optim_step", "save_weights", "load_weights",
                 "save_weights_for_sampler", "create_sampling_session", "asample"):
        app.post(f"/api/v1/{name}", name=name)(json_call(getattr(gateway, name)))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise InvalidArgument(f"forward_backward: the body must be {PROTOBUF} (tinker SDK 0.25 or later)")
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
            except zstandard.ZstdError as exc:
                raise InvalidArgument(f"forward_backward: the zstd body does not decompress ({exc})") from None
        return gateway.forward_backward(parse_forward_backward(body))

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str) -> dict:
        return gateway.training_run(model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict:
        return gateway.checkpoints(model_id)

    @app.get("/api/v1/samplers/{sampling_session_id}")
    async def get_sampler(sampling_session_id: str) -> dict:
        return gateway.get_sampler(sampling_session_id)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _json(request)
        request_id = str(body.get("request_id", ""))
        outcome = await gateway.futures.wait(request_id, gateway.config.long_poll_seconds)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if outcome.proto is not None:
            if PROTOBUF not in request.headers.get("accept", ""):
                raise InvalidArgument(f"request {request_id}'s result is {PROTOBUF}; send Accept: {PROTOBUF}")
            return Response(outcome.proto, media_type=PROTOBUF)
        return JSONResponse(outcome.reply())

    return app
