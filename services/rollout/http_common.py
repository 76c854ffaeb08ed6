"""What every route of the rollout's HTTP API shares: JSON in (errors naming
the field), JSON out, and OpenAI-shaped errors with the status that matches
each domain error."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from flywheel.errors import InvalidArgument
from services.rollout.core import QueueFull

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 409, "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                410: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None, "code": status}}


def error_response(exc: Exception) -> JSONResponse:
    code = getattr(exc, "code", "INTERNAL")
    status = getattr(exc, "http_status", None) or HTTP_STATUS.get(code, 500)
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


async def parse(request: Request, model: type[BaseModel]) -> Any:
    data = await json_body(request)
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


