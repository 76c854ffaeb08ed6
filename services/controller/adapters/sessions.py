"""The HTTP side of external agents: a rollout replica's session API, and a
user's agent service.

`SessionClient` manages one replica's sessions with the replica's bearer
token (the one the controller uses for its gRPC):

    POST   /v1/sessions        {"ttl_seconds", "metadata"} -> {"id", "key", "base_path", "expires_in"}
    GET    /v1/sessions/{id}   -> {"id", "state", "reward", "calls": [...]}
    DELETE /v1/sessions/{id}

`AgentService` runs one episode of a user's agent served over HTTP: it POSTs
`{"task", "base_url", "api_key", "session_id"}` and reads `{"reward"}`.

Every call has a deadline, and failures raise `flywheel.errors`: 404
NotFound; 410 SessionLost (an Aborted: the records are gone because the
replica restarted or the session expired, so the task is retried); 401/403 Unauthenticated; 429
ResourceExhausted; other 4xx InvalidArgument; 5xx and connection errors
Unavailable; timeouts DeadlineExceeded. Wire JSON becomes the domain's
session types (`services/controller/rollouts/episodes.py`) here and nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from flywheel.common.kept import KeptSet
from flywheel.models.moe import routing_from_json
from flywheel.common.provenance import VersionSpan
from flywheel.errors import (
    DeadlineExceeded,
    FlywheelError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from flywheel.runtime.tls import client_ssl_context, process_tls
from services.controller.domain import RAW, FinishReason, Generation, SampledDistribution
from services.controller.rollouts.episodes import OpenedSession, SessionLost, SessionRecord


def _message(response: httpx.Response) -> str:
    """The OpenAI-shaped error's message, else the body's start."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return response.text[:300] or response.reason_phrase


def error_of(response: httpx.Response, what: str) -> FlywheelError:
    status, message = response.status_code, f"{what}: HTTP {response.status_code}: {_message(response)}"
    if status == 404:
        return NotFound(message)
    if status == 410:
        return SessionLost(f"{message} (the session's records are gone: the replica restarted or the session expired)")
    if status in (401, 403):
        return Unauthenticated(message)
    if status == 429:
        return ResourceExhausted(message)
    if status == 504:
        return DeadlineExceeded(message)
    if status >= 500:
        return Unavailable(message)
    return InvalidArgument(message)


async def http_request(client: httpx.AsyncClient, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
    try:
        response = await client.request(method, url, **kwargs)
    except httpx.TimeoutException as exc:
        raise DeadlineExceeded(f"{what}: no answer in time ({type(exc).__name__})") from None
    except httpx.TransportError as exc:
        raise Unavailable(f"{what}: {type(exc).__name__}: {exc}") from None
    if response.is_error:
        raise error_of(response, what)
    return response


def json_object(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        raise InvalidArgument(f"{what}: the answer is not JSON: {response.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"{what}: expected a JSON object, got {type(body).__name__}")
    return body


def _finish(value: Any) -> FinishReason:
    try:
        return FinishReason(value)
    except ValueError:
        return FinishReason.ERROR  # an unknown reason is not trusted as a clean stop


def session_call(data: Mapping[str, Any]) -> Generation:
    return Generation(
        prompt_token_ids=[int(i) for i in data["prompt_token_ids"]],
        completion_token_ids=[int(i) for i in data["completion_token_ids"]],
        completion_logprobs=[float(lp) for lp in data["logprobs"]],
        version_start=int(data["version_start"]),
        version_end=int(data["version_end"]),
        finish_reason=_finish(data.get("finish_reason")),
        text=str(data.get("text", "")),
        engine=str(data.get("replica", "")),
        distribution=_distribution(data.get("logprobs_distribution")),
        # An older rollout's records have none: every token is then attributed to version_start.
        version_spans=[VersionSpan(int(v), int(a), int(b)) for v, a, b in data.get("version_spans") or ()],
        kept_sets=[KeptSet(int(k["position"]), int(k["size"]), tuple(int(i) for i in k.get("token_ids") or ()),
                           bool(k.get("constrained", False))) for k in data.get("kept_sets") or ()],
        routed_experts=routing_from_json(data["routed_experts"]) if data.get("routed_experts") else None,
    )


def _distribution(data: Mapping[str, Any] | None) -> SampledDistribution:
    """A record's distribution; one without (an older rollout) is raw, what those returned."""
    if not data:
        return RAW
    return SampledDistribution(temperature=float(data["temperature"]), top_k=int(data["top_k"]),
                               top_p=float(data["top_p"]), penalised=bool(data.get("penalised", False)))


class SessionClient:
    """One rollout replica's session management API."""

    def __init__(
        self, http_url: str, *, token: str | None = None, timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`http_url`: the replica's HTTP root ("http://host:port"); `transport`: for tests."""
        self.http_url = http_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Verified against this process's CA when the URL is https (flywheel.runtime.tls).
        verify = client_ssl_context(process_tls()) or True
        self._http = httpx.AsyncClient(base_url=self.http_url, headers=headers, timeout=timeout, transport=transport,
                                       verify=verify)

    async def close(self) -> None:
        await self._http.aclose()

    async def open(self, *, ttl_seconds: float | None = None, metadata: Mapping[str, str] | None = None) -> OpenedSession:
        what = f"rollout {self.http_url} open session"
        body: dict[str, Any] = {"metadata": {str(k): str(v) for k, v in (metadata or {}).items()}}
        if ttl_seconds is not None:
            body["ttl_seconds"] = float(ttl_seconds)
        data = json_object(await http_request(self._http, "POST", "/v1/sessions", what, json=body), what)
        try:
            return OpenedSession(
                id=str(data["id"]), key=str(data["key"]), base_url=f"{self.http_url}{data['base_path']}",
                expires_in=float(data.get("expires_in", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{what}: unexpected answer ({type(exc).__name__}: {exc})") from None

    async def read(self, session_id: str) -> SessionRecord:
        """The session's state, posted reward and calls, in call order."""
        what = f"rollout {self.http_url} session {session_id}"
        data = json_object(await http_request(self._http, "GET", f"/v1/sessions/{session_id}", what), what)
        try:
            reward = data.get("reward")
            return SessionRecord(
                id=str(data.get("id", session_id)), state=str(data.get("state", "")),
                reward=None if reward is None else float(reward),
                calls=[session_call(c) for c in data.get("calls") or ()],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{what}: malformed record ({type(exc).__name__}: {exc})") from None

    async def delete(self, session_id: str) -> None:
        what = f"rollout {self.http_url} delete session {session_id}"
        await http_request(self._http, "DELETE", f"/v1/sessions/{session_id}", what)


class AgentService:
    """A user's agent behind HTTP: one POST per episode, answered with the episode's reward."""

    def __init__(self, url: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url
        # No client deadline of its own: the worker's per-episode limit bounds the whole call.
        self._http = httpx.AsyncClient(timeout=None, transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def __call__(self, task: dict[str, Any], base_url: str, api_key: str, session_id: str) -> float | None:
        what = f"agent service {self.url}"
        # default=str: dataset rows may hold values JSON has no type for (dates, decimals).
        payload = json.dumps({"task": task, "base_url": base_url, "api_key": api_key, "session_id": session_id},
                             default=str)
        response = await http_request(self._http, "POST", self.url, what, content=payload,
                                  headers={"Content-Type": "application/json"})
        reward = json_object(response, what).get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise InvalidArgument(f"{what}: reward must be a number or null, got {reward!r}")
        return None if reward is None else float(reward)
