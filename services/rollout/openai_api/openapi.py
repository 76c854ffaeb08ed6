"""The OpenAPI 3.1 document of the rollout's HTTP API (served at `GET /openapi.json`).

The routes are plain Starlette routes (services.rollout.openai_api.http_api says why), so
FastAPI cannot describe them; this module does. Request bodies come from the
pydantic models that validate them (services.rollout.openai_api.openai_protocol), so the
document cannot drift from what is accepted; where a model takes any JSON
(`messages`, `tools`) and the handler validates it, the schema here says what the
handler checks, never more (a body the document forbids must be refused: the
HTTP fuzz test, tests/integration/test_http_fuzz.py, sends such bodies). Answer
bodies are described here and checked against real answers by the same test.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from services.rollout.openai_api.openai_protocol import (
    ChatRequest, CompletionRequest, FinishSessionRequest, OpenSessionRequest, ResponsesRequest,
)
from services.rollout.serving.prompts import ROLES

_REF = "#/components/schemas/{model}"
#: The status codes of errors, what each means here.
_ERRORS = {
    400: "invalid request: the message names the field",
    401: "missing or wrong bearer token (or session key)",
    403: "the token's scope is too small",
    404: "unknown model, session or previous response",
    409: "no model is loaded, or the request was aborted by a weight update",
    410: "the session expired, was deleted, or was opened before this rollout restarted",
    429: "too much work admitted (limits.max_pending_requests) or too many sessions; retry after Retry-After seconds",
    503: "the engine is unavailable",
    504: "the request's deadline passed",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT, _STR, _NUM, _BOOL = {"type": "integer"}, {"type": "string"}, {"type": "number"}, {"type": "boolean"}
_IDS = {"type": "array", "items": _INT}
_OBJECT = {"type": "object"}

_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"}, "text": _STR}}}
_NAMES = {"name": _nullable(_STR), "tool_call_id": _nullable(_STR)}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": _STR, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1},
        "arguments": {"anyOf": [_OBJECT, {"type": "string", "contentMediaType": "application/json"}]}}}}}
#: A message has content, or is the assistant's and makes tool calls (then its content may be null).
_MESSAGE = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "additionalProperties": False,
     "properties": {"role": {"enum": list(ROLES)}, "content": {"anyOf": [_STR, _TEXT_PARTS]}, **_NAMES,
                    "tool_calls": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}}},
    {"type": "object", "required": ["role", "tool_calls"], "additionalProperties": False,
     "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [_STR, _TEXT_PARTS, {"type": "null"}]},
                    **_NAMES, "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL}}},
]}
_TOOL = {"type": "object", "required": ["function"],
         "properties": {"type": _STR, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string", "minLength": 1}}}}}
#: Handler-validated fields of the request models, described as the handlers check them.
_REQUEST_FIELDS = {
    "ChatRequest": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "tools": _nullable({"type": "array", "items": _TOOL}),
    },
}

_SPANS = {"type": "array", "items": {"type": "array", "items": _INT, "minItems": 3, "maxItems": 3},
          "description": "Flywheel: [version, start, end] triples, in order over the choice's token_ids (end "
                         "exclusive): the weight version that produced each token"}
_WEIGHT_VERSION = {"type": "object", "required": ["start", "end"],
                   "properties": {"start": _INT, "end": _INT, "spans": _SPANS},
                   "description": "Flywheel: the weight versions of the first and last generated token; a choice's "
                                  "also the version of each token (spans)"}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}
_FINISH = _nullable(_STR)
_STOP_REASON = {"anyOf": [_STR, _INT, {"type": "null"}]}
#: One server-sent event: `data` is a JSON chunk (or `[DONE]`); the Responses API names its events.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"event": _STR, "data": _STR, "id": _STR}}

def _completion(kind: str, content: str, choice: dict[str, Any], **properties: Any) -> dict[str, Any]:
    """A completions answer (legacy or chat): the envelope, usage and per-choice fields both share, with
    `object` = `kind`, each choice's `content` field required and described in `choice`, and the answer's
    own top-level `properties`."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": kind}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", content, "finish_reason"],
                "properties": {"index": _INT, "finish_reason": _FINISH, "stop_reason": _STOP_REASON,
                               "logprobs": _nullable(_OBJECT), "token_ids": _IDS,
                               "weight_version": _WEIGHT_VERSION, **choice}}},
            "usage": _USAGE, "weight_version": _WEIGHT_VERSION, **properties,
        },
    }


_ANSWERS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "code"],
            "properties": {"message": _STR, "type": _STR, "param": _nullable(_STR),
                           "code": {"anyOf": [_INT, _STR, {"type": "null"}]}}}},
    },
    "Health": {"type": "object", "required": ["status", "weight_version", "paused"],
               "properties": {"status": {"enum": ["ok", "no model"]}, "weight_version": _INT, "paused": _BOOL}},
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                           "max_model_len": _INT, "weight_version": _INT}}}},
    },
    "Completion": _completion(
        "text_completion", "text", {"text": _STR, "prompt_token_ids": _IDS},
        prompt_token_ids={"anyOf": [_IDS, {"type": "array", "items": _IDS}],
                          "description": "Flywheel: the prompt's ids (a list of them for several prompts)"},
    ),
    "ChatCompletion": _completion(
        "chat.completion", "message", {
            "message": {"type": "object", "required": ["role", "content"],
                        "properties": {"role": {"const": "assistant"}, "content": _nullable(_STR),
                                       "tool_calls": {"type": "array", "items": {
                                           "type": "object", "required": ["id", "type", "function"],
                                           "properties": {"id": _STR, "type": {"const": "function"},
                                                          "function": {"type": "object",
                                                                       "required": ["name", "arguments"],
                                                                       "properties": {"name": _STR,
                                                                                      "arguments": _STR}}}}}}},
        },
        prompt_token_ids=_IDS,
    ),
    "Response": {
        "type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": _STR, "object": {"const": "response"}, "created_at": _INT,
            "status": {"enum": ["completed", "incomplete", "in_progress"]}, "model": _STR,
            "output": {"type": "array", "items": {
                "type": "object", "required": ["type", "id", "status"],
                "properties": {"type": {"enum": ["message", "function_call"]}, "id": _STR, "status": _STR,
                               "role": _STR, "content": {"type": "array", "items": _OBJECT}, "call_id": _STR,
                               "name": _STR, "arguments": _STR}}},
            "usage": _nullable({"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                                "properties": {"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}}),
            "prompt_token_ids": _IDS, "token_ids": _IDS, "weight_version": _WEIGHT_VERSION,
        },
    },
    "OpenedSession": {
        "type": "object", "required": ["id", "key", "base_path", "expires_in"],
        "properties": {"id": _STR, "key": _STR, "base_path": _STR, "expires_in": _NUM},
    },
    "Session": {
        "type": "object", "required": ["id", "state", "reward", "metadata", "calls"],
        "properties": {
            "id": _STR, "state": {"enum": ["open", "finished"]}, "reward": _nullable(_NUM),
            "metadata": {"type": "object", "additionalProperties": _STR},
            "calls": {"type": "array", "items": {
                "type": "object",
                "required": ["api", "prompt_token_ids", "completion_token_ids", "logprobs", "version_start",
                             "version_end", "finish_reason", "replica", "text"],
                "properties": {"api": _STR, "prompt_token_ids": _IDS, "completion_token_ids": _IDS,
                               "logprobs": {"type": "array", "items": _NUM}, "version_start": _INT,
                               "version_end": _INT, "version_spans": _SPANS, "finish_reason": _STR, "replica": _STR,
                               "text": _STR,
                               "logprobs_distribution": {
                                   "type": "object", "required": ["temperature", "top_k", "top_p", "penalised"],
                                   "properties": {"temperature": _NUM, "top_k": _INT, "top_p": _NUM,
                                                  "penalised": _BOOL}}}}},
        },
    },
    "DeletedSession": {"type": "object", "required": ["id", "deleted"], "properties": {"id": _STR, "deleted": _BOOL}},
}


def _request_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    model: type[BaseModel]
    for model in (CompletionRequest, ChatRequest, ResponsesRequest, OpenSessionRequest, FinishSessionRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        for name, described in _REQUEST_FIELDS.get(model.__name__, {}).items():
            schema["properties"][name] = {**described, "title": schema["properties"][name].get("title", name)}
        schemas[model.__name__] = schema
    return schemas


def _errors(*codes: int) -> dict[str, Any]:
    out = {}
    for code in codes:
        answer: dict[str, Any] = {"description": _ERRORS[code],
                                  "content": {"application/json": {"schema": _ref("Error")}}}
        if code == 429:
            answer["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                                 "required": False, "schema": {"type": "string"}}}
        out[str(code)] = answer
    return out


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _body(name: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": _ref(name)}}}


_SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": _STR,
               "description": "the session's id, from POST /v1/sessions"}
_ID = {**_SESSION_ID, "name": "id"}
_GENERATION_ERRORS = (400, 401, 403, 404, 409, 429, 503, 504)


def _generation(summary: str, request: str, answer: str, session: bool) -> dict[str, Any]:
    ok = _json(answer, "the answer; with stream=true, server-sent events ending in `data: [DONE]`")
    ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    operation = {"summary": summary, "requestBody": _body(request),
                 "responses": {"200": ok, **_errors(*_GENERATION_ERRORS, *((410,) if session else ()))}}
    if session:
        operation["parameters"] = [_SESSION_ID]
    return operation


def openapi_document(*, metrics_auth: bool) -> dict[str, Any]:
    """The whole document; `metrics_auth`: whether /metrics takes a token (server.metrics_auth)."""
    paths: dict[str, Any] = {
        "/health": {"get": {"summary": "200 once a model is served", "security": [],
                            "responses": {"200": _json("Health", "a model is served"),
                                          "503": _json("Health", "no model is loaded")}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics", "security": [{"bearer": []}] if metrics_auth else [],
            "responses": {"200": {"description": "Prometheus text format",
                                  "content": {"text/plain": {"schema": _STR}}},
                          **(_errors(401) if metrics_auth else {})}}},
        "/openapi.json": {"get": {"summary": "this document", "security": [],
                                  "responses": {"200": {"description": "OpenAPI 3.1",
                                                        "content": {"application/json": {"schema": _OBJECT}}}}}},
        "/v1/sessions": {"post": {
            "summary": "open an agent session (service token)", "requestBody": _body("OpenSessionRequest", False),
            "responses": {"200": _json("OpenedSession", "its id, key and base path"), **_errors(400, 401, 403, 429)}}},
        "/v1/sessions/{id}": {
            "parameters": [_ID],
            "get": {"summary": "a session's state and records (service token)",
                    "responses": {"200": _json("Session", "the session"), **_errors(401, 403, 404, 410)}},
            "delete": {"summary": "free a session's records (service token)",
                       "responses": {"200": _json("DeletedSession", "deleted"), **_errors(401, 403, 404, 410)}},
        },
        "/sessions/{session_id}/v1/finish": {"post": {
            "summary": "end the session, with the episode's reward", "parameters": [_SESSION_ID],
            "requestBody": _body("FinishSessionRequest", False),
            "responses": {"200": _json("Session", "the finished session"), **_errors(400, 401, 404, 410)}}},
    }
    for prefix, session in (("/v1", False), ("/sessions/{session_id}/v1", True)):
        where = " (within a session: recorded token-exact)" if session else ""
        paths[f"{prefix}/models"] = {"get": {
            "summary": "the served model and its weight version", **({"parameters": [_SESSION_ID]} if session else {}),
            "responses": {"200": _json("ModelList", "the served model"),
                          **_errors(401, 403, *((404, 410) if session else ()))}}}
        paths[f"{prefix}/completions"] = {"post": _generation(
            f"text or token-id prompts{where}", "CompletionRequest", "Completion", session)}
        paths[f"{prefix}/chat/completions"] = {"post": _generation(
            f"chat messages, tools, structured output{where}", "ChatRequest", "ChatCompletion", session)}
        paths[f"{prefix}/responses"] = {"post": _generation(
            f"the Responses API{where}", "ResponsesRequest", "Response", session)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Flywheel rollout", "version": "1",
                 "description": "OpenAI-compatible generation with Flywheel's extensions (prompt_token_ids, "
                                "token_ids, weight_version) and agent sessions; see docs/external-agents.md."},
        "components": {
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "a token of the agent scope or larger; a session's routes take that session's key"}},
            "schemas": copy.deepcopy({**_request_schemas(), **_ANSWERS}),
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
