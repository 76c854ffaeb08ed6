"""The controller's status page: one web page that follows the run live.

    GET /             the page (static/status.html); it polls /api/status every 2 s
    GET /api/status   the run as JSON: phase, components and their weight versions,
                      staleness, reward and validation curves, timeline, errors, and
                      the fleet's verdict on each version trained on (with what each
                      replica measured of it)

Read-only: nothing here changes the run (Stop is a gRPC call). Everything
comes from `RunManager.status()`, the same snapshot the gRPC Status answers.

With tokens configured, /api/status needs `Authorization: Bearer <token>` of
scope viewer or above (401 without one or with a wrong one, 403 for too small a
scope). The page itself is public but holds no data: its script reads the token
from the URL's fragment (`/#token=...`, which browsers never send) and sends it
as that header. A token rather than a localhost-only listener, because the page
is reached from elsewhere: `kubectl port-forward`, a published compose port, a
Service.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from flywheel.errors import PermissionDenied, Unauthenticated
from flywheel.runtime.auth import Scope, TokenScopes, accepted_tokens, viewer_token
from flywheel.runtime.server_config import ServerConfig
from flywheel.synchronizer.types import Role
from services.controller.ops.runs import RunManager, RunStatus

PAGE = Path(__file__).with_name("static") / "status.html"
#: Metrics drawn as curves: (curve name, the metric, which rows carry it).
REWARD = "rollout/reward_mean"
VALIDATION_METRICS = ("val/accuracy", "val/reward")
#: How many timeline entries and points per curve the page gets (the newest).
TIMELINE_LIMIT = 200
CURVE_LIMIT = 2000
#: Reading the run's status changes nothing: the read-only scope suffices.
STATUS_SCOPE = Scope.VIEWER


def _validation_metric(history: list[tuple[int, int, dict[str, float]]]) -> str:
    for name in VALIDATION_METRICS:
        if any(name in row for _, _, row in history):
            return name
    return VALIDATION_METRICS[0]


def status_json(s: RunStatus) -> dict[str, Any]:
    trainer_version = s.trainer_version
    components = [
        {
            "id": c.id, "role": c.role.name.lower(), "state": c.state.name.lower(), "address": c.identity.address,
            "step": c.step, "weight_version": c.weight_version, "last_heartbeat_unix_ms": c.last_heartbeat_ms,
            "labels": dict(c.identity.labels),
            # Rollouts: how many versions behind the trainer the weights they serve are.
            "behind": max(0, trainer_version - c.weight_version) if c.role == Role.ROLLOUT else None,
            # Out of service since a weight update failed: why (None when it serves).
            "quarantined": c.quarantine_reason if c.quarantined else None,
            "identity": c.weight_identity.hex()[:16] if c.weight_identity else None,
        }
        for c in s.components
    ]
    val_metric = _validation_metric(s.history)
    latest_train = next((row for _, _, row in reversed(s.history) if REWARD in row), {})
    return {
        "run_id": s.run_id, "phase": s.phase, "mode": s.mode, "message": s.message,
        "step": s.step, "total_steps": s.total_steps, "trainer_version": trainer_version,
        "pool_size": s.pool_size, "in_flight": s.in_flight,
        "components": components,
        "staleness": {k: latest_train[f"staleness/{k}"] for k in ("mean", "min", "max") if f"staleness/{k}" in latest_train},
        "curves": {
            "reward": [[step, row[REWARD]] for step, _, row in s.history if REWARD in row][-CURVE_LIMIT:],
            "validation": [[step, row[val_metric]] for step, _, row in s.history if val_metric in row][-CURVE_LIMIT:],
            "validation_metric": val_metric,
        },
        "timeline": s.timeline[-TIMELINE_LIMIT:],
        "verdicts": list(s.verdicts or []),
        "errors": [
            {"module": e.module, "severity": e.severity, "message": e.message, "unix_ms": e.unix_ms} for e in s.errors
        ],
    }


def status_link(url: str, server: ServerConfig) -> str:
    """The page's address as a user opens it: with a viewer token in the fragment when the
    page needs a token (the browser keeps it out of requests); a larger scope's token is
    never put there, so without a viewer token the user is told what to add."""
    if not accepted_tokens(server):
        return url
    token = viewer_token(server)
    return f"{url}#token={token}" if token else f"{url} (add #token=<a viewer token> to open it)"


def create_app(runs: RunManager, tokens: TokenScopes) -> FastAPI:
    """`tokens`: the bearer tokens accepted, by scope (none: auth off, as on the gRPC port)."""
    app = FastAPI(title="Flywheel controller", docs_url=None, redoc_url=None, openapi_url=None)
    page = PAGE.read_text()
    # No caching: the page polls, and a proxy must not hand it an old run (nor a refusal).
    no_store = {"Cache-Control": "no-store"}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/api/status")
    async def status(request: Request) -> JSONResponse:
        if tokens:
            try:
                tokens.admit(request.headers.get("authorization"), STATUS_SCOPE, "GET /api/status")
            except Unauthenticated as exc:
                return JSONResponse({"error": str(exc)}, status_code=401,
                                    headers={**no_store, "WWW-Authenticate": "Bearer"})
            except PermissionDenied as exc:
                return JSONResponse({"error": str(exc)}, status_code=403, headers=no_store)
        return JSONResponse(status_json(runs.status()), headers=no_store)

    return app
