"""The controller's status page: one web page that follows the run live.

    GET /             the page (static/status.html); it polls /api/status every 2 s
    GET /api/status   the run as JSON: phase, components and their weight versions,
                      staleness, reward and validation curves, timeline, errors

Read-only: nothing here changes the run (Stop is a gRPC call). Everything
comes from `RunManager.status()`, the same snapshot the gRPC Status answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from flywheel.synchronizer.types import Role
from services.controller.ops.runs import RunManager, RunStatus

PAGE = Path(__file__).with_name("static") / "status.html"
#: Metrics drawn as curves: (curve name, the metric, which rows carry it).
REWARD = "rollout/reward_mean"
VALIDATION_METRICS = ("val/accuracy", "val/reward")
#: How many timeline entries and points per curve the page gets (the newest).
TIMELINE_LIMIT = 200
CURVE_LIMIT = 2000


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
        "errors": [
            {"module": e.module, "severity": e.severity, "message": e.message, "unix_ms": e.unix_ms} for e in s.errors
        ],
    }


def create_app(runs: RunManager) -> FastAPI:
    app = FastAPI(title="Flywheel controller", docs_url=None, redoc_url=None, openapi_url=None)
    page = PAGE.read_text()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/api/status")
    async def status() -> JSONResponse:
        # No caching: the page polls, and a proxy must not hand it an old run.
        return JSONResponse(status_json(runs.status()), headers={"Cache-Control": "no-store"})

    return app
