"""What every route of the rollout's HTTP API shares: JSON in (errors naming
the field), JSON out, and OpenAI-shaped errors with the status that matches
each domain error."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from flywheel.errors import HTTP_STATUS, FlywheelError, InvalidArgument
from services.rollout.serving.core import QueueFull

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 410: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None, "code": status}}


def error_status(exc: Exception) -> tuple[int, dict[str, str]]:
    """The HTTP status of a domain error, and the headers that go with it (every dialect's)."""
    code = getattr(exc, "code", "INTERNAL")
    status = getattr(exc, "http_status", None) or HTTP_STATUS.get(code, 500)
    headers = {}
    if isinstance(exc, QueueFull):
        # Whole seconds (RFC 9110), rounded, not ceiled: the hint is spread over [hint, 2 x hint]
        # (RolloutCore.reserve), and a ceiling would turn a 1 s hint into 2 s for everyone.
        headers["Retry-After"] = str(max(1, round(exc.retry_after_seconds)))
    return status, headers


def error_response(exc: Exception) -> JSONResponse:
    status, headers = error_status(exc)
    return JSONResponse(error_body(status, str(exc)), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error answer OpenAI-shaped: domain errors with their status, the router's (unknown path,
    wrong method) too, and anything unexpected a 500 (Starlette re-raises it after answering: the
    server logs its traceback)."""

    @app.exception_handler(FlywheelError)
    async def domain_error(request: Request, exc: FlywheelError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def _validation_message(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown parameter"
    return f"{where}: {err['msg']}"


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"body: not valid UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"body: not valid JSON: {exc}") from None


async def parse(request: Request, model: type[BaseModel], *, may_be_empty: bool = False) -> Any:
    """The body validated by `model`; `may_be_empty`: an empty body is the model's defaults."""
    data = await json_body(request) if await request.body() or not may_be_empty else {}
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(_validation_message(exc)) from None
    unsupported = body.unsupported()
    if unsupported:
        raise InvalidArgument(f"{unsupported[0]}: not supported by this server")
    return body


def json_response(body: dict[str, Any]) -> Response:
    # Plain JSON types already: skips FastAPI's recursive jsonable_encoder.
    return Response(json.dumps(body, separators=(",", ":")).encode(), media_type="application/json")


