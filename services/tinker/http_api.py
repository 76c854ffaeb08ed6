"""The Tinker API's HTTP routes (those SDK `tinker==0.38` calls), translated to
the gateway's calls (services/tinker/gateway.py, sampler_sessions.py, rest.py).

Auth: the SDK sends its key as `X-API-Key`: a tenant's key
(services/tinker/tenants.py), whose tenant every call then acts for.

Errors answer in the shape the SDK reads (`{"detail": message}`, the message
naming what is wrong), with `x-should-retry: false` on a client's error so
that the SDK raises at once instead of retrying what cannot succeed; a
session that finished is 400 here (409 would be retried). A call this
gateway does not serve answers 404 naming it and why (`REFUSED`), never an
empty success; a body past `max_body_bytes`, as sent or decompressed, 413
(services/tinker/bodies.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flywheel.errors import HTTP_STATUS, FlywheelError, InvalidArgument
from services.tinker import metrics
from services.tinker.bodies import BodyTooLarge, decompressed, read_bounded
from services.tinker.gateway import Gateway
from services.tinker.rest import Rest
from services.tinker.tenants import TenantKeys
from services.tinker.wire import parse_forward_backward

PROTOBUF = "application/x-protobuf"
#: Statuses the SDK retries (408, 409, 429, 5xx) that a client's error must not get: what it gets instead.
_CLIENT_STATUS = {"FAILED_PRECONDITION": 400, "ABORTED": 400}

#: The SDK's calls this gateway does not serve, by route, and why (the 404's message names them).
REFUSED = (
    (r"/training_runs/[^/]+/checkpoints/[^/]+/[^/]+/publish$",
     "publishing and unpublishing checkpoints (publish_checkpoint_from_tinker_path, "
     "unpublish_checkpoint_from_tinker_path): a tenant's checkpoints are its own here, never public"),
    (r"/training_runs/[^/]+/checkpoints/[^/]+/[^/]+/external_weights_urls$",
     "download URLs of external weights (get_external_weights_urls): weights are not exported off this deployment"),
    (r"/save_weights_external$", "saving weights to external storage (save_weights_external)"),
    (r"/copy_weights$", "copying weights between runs (copy_weights)"),
    (r"/create_custom_loss$", "server-side custom losses (create_custom_loss); the SDK's client-side "
                              "forward_backward_custom works, through cross_entropy"),
    (r"/retrieve_futures$", "batched futures (retrieve_futures): the client config keeps "
                            "sample_use_retrieve_futures off, so the SDK polls each request with retrieve_future"),
    (r"/join_sampling_session$", "joining a sampling session (the client config keeps "
                                 "sample_join_sampling_session off)"),
    (r"/sessions/search$", "searching sessions (search_sessions); list_sessions is served"),
    (r"/sessions/[^/]+/(project|trace_export)$", "projects and session traces (assign_session_project, "
                                                 "export_session_trace)"),
    (r"/(audit|billing/.*)$", "organizations' audit logs and billing (AdminClient)"),
    (r"/auth/token$", "JWT credentials (the client config says pjwt_auth_enabled false: keys are sent as they are)"),
)


def _error(status: int, message: str) -> JSONResponse:
    headers = {"x-should-retry": "false"} if 400 <= status < 500 and status not in (408, 429) else None
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _refused(path: str) -> str | None:
    tail = path.removeprefix("/api/v1")
    return next((why for pattern, why in REFUSED if re.search(pattern, tail)), None)


def create_app(gateway: Gateway, keys: TenantKeys) -> FastAPI:
    app = FastAPI(title="Flywheel Tinker gateway", docs_url=None, redoc_url=None, openapi_url=None)
    rest = Rest(gateway)
    limit = gateway.config.max_body_bytes

    @app.exception_handler(FlywheelError)
    async def domain_error(request: Request, exc: FlywheelError) -> JSONResponse:
        return _error(_CLIENT_STATUS.get(exc.code) or HTTP_STATUS.get(exc.code, 500), str(exc))

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return _error(413, str(exc))

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        if request.method == "POST":  # a model's numbered request on a route not served (save_weights_external)
            try:
                _pass_over(request.state.tenant, json.loads(await _body(request) or b"{}"))
            except (AttributeError, ValueError, FlywheelError):
                pass  # no tenant, no JSON object, or a body past the limit: no model's number to skip
        if exc.status_code in (404, 405):
            why = _refused(request.url.path)
            what = f"is not served by this gateway: {why}" if why else "is not served by this gateway"
            return _error(404, f"{request.method} {request.url.path} {what}")
        return _error(exc.status_code, f"{request.method} {request.url.path} {exc.detail}")

    metrics.SESSIONS.set_function(gateway.sessions.running)

    @app.middleware("http")
    async def authorize_and_count(request: Request, call_next):
        response = await _authorized(request, call_next)
        route = request.scope.get("route")
        metrics.REQUESTS.labels(getattr(route, "path", "unknown"), str(response.status_code)).inc()
        return response

    async def _authorized(request: Request, call_next):
        if request.url.path != "/api/v1/healthz":
            try:
                request.state.tenant = keys.tenant(request.headers.get("x-api-key"),
                                                   f"{request.method} {request.url.path}")
            except FlywheelError as exc:
                return _error(HTTP_STATUS[exc.code], str(exc))
        return await call_next(request)

    async def _body(request: Request) -> bytes:
        return await read_bounded(request.headers.get("content-length"), request.stream(), limit,
                                  f"{request.method} {request.url.path}")

    async def _json(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await _body(request) or b"{}")
        except ValueError as exc:
            raise InvalidArgument(f"{request.url.path}: the body is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise InvalidArgument(f"{request.url.path}: the body must be a JSON object")
        return body

    def _owned(request: Request) -> str:
        """The caller's tenant, refusing the listing options that would reach beyond its own."""
        scope, project = request.query_params.get("access_scope"), request.query_params.get("project_id")
        if scope not in (None, "owned"):
            raise InvalidArgument(f"access_scope={scope!r} is not served: a tenant sees its own runs and sessions only")
        if project is not None:
            raise InvalidArgument("project_id is not served: this gateway has no projects")
        return request.state.tenant

    def _null() -> Response:
        return Response(status_code=200, content=b"null", media_type="application/json")

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
        return {"sample_cancel_enabled": True}  # POST cancel_future is served

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return gateway.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        body = await _json(request)  # tags and sdk_version: nothing here depends on them
        return {"type": "create_session", "session_id": gateway.create_session(request.state.tenant, body)}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> Response:
        body = await _json(request)
        try:
            gateway.sessions.heartbeat(str(body.get("session_id", "")), request.state.tenant)
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
        gateway.finish_session(request.state.tenant, session_id, kind, body.get("detail"))
        return _null()

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        return rest.session(_owned(request), session_id)

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
        return rest.sessions(_owned(request), limit, offset)

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict:
        await _body(request)
        return {"status": "accepted"}  # the SDK's client-side events: not collected here

    def _pass_over(tenant: str, body: object) -> None:
        """The SDK numbers a model's requests (seq_id) and the gateway runs them in that order: one refused
        before it was queued must not leave the model's later requests waiting for it forever."""
        if isinstance(body, dict) and "model_id" in body and "seq_id" in body:
            gateway.models.pass_over(body["model_id"], tenant, body["seq_id"])

    # The calls whose body is a JSON object, answered by the gateway's method of the same name.
    def json_call(call):
        async def route(request: Request) -> dict:
            body = await _json(request)
            try:
                return call(request.state.tenant, body)
            except FlywheelError:
                _pass_over(request.state.tenant, body)
                raise
        return route

    for name, call in (("create_model", gateway.create_model), ("get_info", gateway.get_info),
                       ("optim_step", gateway.optim_step), ("save_weights", gateway.save_weights),
                       ("load_weights", gateway.load_weights),
                       ("save_weights_for_sampler", gateway.sampling.save_weights_for_sampler),
                       ("create_sampling_session", gateway.sampling.create_sampling_session),
                       ("asample", gateway.sampling.asample), ("weights_info", rest.weights_info)):
        app.post(f"/api/v1/{name}", name=name)(json_call(call))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise InvalidArgument(f"forward_backward: the body must be {PROTOBUF} (tinker SDK 0.25 or later)")
        body = await _body(request)
        if request.headers.get("content-encoding") == "zstd":
            body = decompressed(body, limit, "forward_backward")
        parsed = parse_forward_backward(body)
        try:
            return gateway.forward_backward(request.state.tenant, parsed)
        except FlywheelError:
            _pass_over(request.state.tenant, {"model_id": parsed.model_id, "seq_id": parsed.seq_id})
            raise

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        return rest.training_runs(_owned(request), limit, offset)

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request) -> dict:
        return rest.training_run(_owned(request), model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request) -> dict:
        return rest.checkpoints_of(request.state.tenant, model_id)

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(model_id: str, kind: str, name: str, request: Request) -> Response:
        await rest.delete_checkpoint(request.state.tenant, model_id, f"{kind}/{name}")
        return _null()

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
    async def checkpoint_ttl(model_id: str, kind: str, name: str, request: Request) -> Response:
        rest.set_ttl(request.state.tenant, model_id, f"{kind}/{name}", await _json(request))
        return _null()

    @app.get("/api/v1/checkpoints")
    async def user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
        return rest.user_checkpoints(request.state.tenant, limit, offset)

    @app.get("/api/v1/samplers/{sampling_session_id}")
    async def get_sampler(sampling_session_id: str, request: Request) -> dict:
        return gateway.sampling.get_sampler(request.state.tenant, sampling_session_id)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _json(request)
        request_id = str(body.get("request_id", ""))
        outcome = await gateway.futures.wait(request_id, request.state.tenant, gateway.config.long_poll_seconds)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if outcome.proto is not None:
            if PROTOBUF not in request.headers.get("accept", ""):
                raise InvalidArgument(f"request {request_id}'s result is {PROTOBUF}; send Accept: {PROTOBUF}")
            return Response(outcome.proto, media_type=PROTOBUF)
        return JSONResponse(outcome.reply())

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> Response:
        body = await _json(request)
        gateway.futures.cancel(str(body.get("request_id", "")), request.state.tenant)
        return _null()

    return app
