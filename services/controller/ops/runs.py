"""The controller service's runs: start one from YAML, stop it, report on it.

`RunManager` owns at most one active run. `start()` validates the YAML (a
bad field is InvalidArgument naming it), creates the run directory
(`<runs_dir>/<run id>/` with the resolved config and metrics.jsonl), opens
connections to the services (`connect`, the gRPC adapters in the product
path), builds the pipeline and runs the main loop in the background.
`stop()` asks the loop to stop, optionally checkpointing first, and waits up
to a grace period. `status()` and `metrics_after()` read the live pipeline.
`adopt()` reports on a run the launcher drives itself (`run FILE`), so the
same Status, StreamMetrics, Stop and status page serve both ways of running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flywheel.errors import FailedPrecondition, InvalidArgument
from flywheel.runtime.config import ConfigError
from flywheel.runtime.paths import confine
from flywheel.synchronizer.types import Component
from services.controller.assemble import Services, build_pipeline
from services.controller.telemetry.errors_report import ErrorRecord
from services.controller.loop import run
from services.controller.telemetry.metrics_log import MetricsSink
from services.controller.pipeline import Pipeline, RunSummary
from services.controller.run_config import RunConfig, run_config_from_yaml

log = logging.getLogger(__name__)

PHASES = ("idle", "starting", "running", "stopping", "completed", "failed")


@dataclass
class RunStatus:
    run_id: str = ""
    phase: str = "idle"
    mode: str = ""
    step: int = 0
    total_steps: int = 0
    trainer_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    pool_size: int = 0
    in_flight: int = 0
    errors: list[ErrorRecord] = field(default_factory=list)
    message: str = ""
    #: Every component as the synchronizer last reported it (empty without a synchronizer).
    components: list[Component] = field(default_factory=list)
    #: (step, unix_ms, metrics) of every recorded row, oldest first: training steps and validations.
    history: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    #: Syncs, joins, validations and checkpoints, oldest first, each a dict with `kind` and `unix_ms`.
    timeline: list[dict[str, Any]] = field(default_factory=list)
    #: The fleet's verdict on the versions the last batches were trained on, newest first
    #: (weights/verdict.py `verdict_json`: who verified, who is quarantined, each replica's coverage).
    verdicts: list[dict[str, Any]] = field(default_factory=list)


class RunManager:
    def __init__(
        self,
        runs_dir: Path,
        connect: Callable[[RunConfig], Services],
        sinks: Callable[[], Sequence[MetricsSink]] = lambda: (),
    ) -> None:
        self.runs_dir, self.connect, self.sinks = Path(runs_dir), connect, sinks
        self.run_id = ""
        self.run_dir: Path | None = None
        self.phase = "idle"
        self.pipeline: Pipeline | None = None
        self.summary: RunSummary | None = None
        self.message = ""
        self._task: asyncio.Task | None = None
        self._services: Services | None = None

    @property
    def active(self) -> bool:
        return self.phase in ("starting", "running", "stopping")

    async def start(self, config_yaml: str, run_id: str = "") -> tuple[str, Path]:
        if self.active:
            raise FailedPrecondition(f"run {self.run_id} is {self.phase}; stop it first")
        try:
            cfg = run_config_from_yaml(config_yaml)
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        run_id = run_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if "/" in run_id or run_id.startswith("."):
            raise InvalidArgument(f"run_id {run_id!r}: must be a plain directory name")
        # A Start request may name where the run writes, but only inside this controller's runs directory.
        run_dir = confine(cfg.run.output_dir or run_id, [self.runs_dir], "run.output_dir")
        services = self.connect(cfg)
        try:
            pipeline = build_pipeline(cfg, services, run_dir=run_dir, sinks=self.sinks())
        except ConfigError as exc:
            await _close(services)
            raise InvalidArgument(str(exc)) from None
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
        self.run_id, self.run_dir, self.pipeline, self._services = run_id, run_dir, pipeline, services
        self.phase, self.summary, self.message = "starting", None, ""
        self._task = asyncio.ensure_future(self._run(pipeline, services))
        log.info("run started", extra={"run_id": run_id, "run_dir": str(run_dir)})
        return run_id, run_dir

    def adopt(self, run_id: str, run_dir: Path, pipeline: Pipeline, task: asyncio.Task) -> None:
        """Reports on (and stops) a run whose main loop `task` someone else drives."""
        if self.active:
            raise FailedPrecondition(f"run {self.run_id} is {self.phase}")
        self.run_id, self.run_dir, self.pipeline, self._task = run_id, run_dir, pipeline, task
        self.phase, self.summary, self.message = "running", None, ""

        def ended(t: asyncio.Task) -> None:
            if t.cancelled():
                self.phase, self.message = "failed", self.message or "cancelled"
            elif t.exception() is not None:
                exc = t.exception()
                self.phase, self.message = "failed", f"{type(exc).__name__}: {exc}"
            else:
                self.summary = t.result()
                self.phase = "failed" if pipeline.errors.should_stop else "completed"
                self.message = self.summary.stop_reason

        task.add_done_callback(ended)

    async def _run(self, pipeline: Pipeline, services: Services) -> None:
        try:
            self.phase = "running"
            self.summary = await run(pipeline)
            failed = pipeline.errors.should_stop
            self.phase = "failed" if failed else "completed"
            self.message = self.summary.stop_reason
        except Exception as exc:  # the run's failure is reported by status, not raised anywhere
            log.exception("run %s failed", self.run_id)
            pipeline.errors.report("controller", exc, severity="critical")
            self.phase, self.message = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            await _close(services)

    async def stop(self, *, checkpoint: bool, grace_seconds: float) -> str:
        """Stops the active run; the checkpoint path when one was written."""
        if not self.active or self.pipeline is None or self._task is None:
            raise FailedPrecondition("no run is active")
        self.phase = "stopping"
        self.pipeline.state.checkpoint_on_stop = checkpoint
        self.pipeline.state.stop_requested.set()
        done, _ = await asyncio.wait([self._task], timeout=grace_seconds or None)
        if not done:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.phase, self.message = "failed", f"did not stop within {grace_seconds:g}s; cancelled"
        return self.pipeline.state.last_checkpoint_path

    def status(self) -> RunStatus:
        p = self.pipeline
        if p is None:
            return RunStatus(phase=self.phase)
        return RunStatus(
            run_id=self.run_id,
            phase=self.phase,
            mode=p.config.mode,
            step=p.train_worker.step,
            total_steps=p.config.run.max_steps or 0,
            trainer_version=p.train_worker.version,
            metrics=p.memory.latest(),
            pool_size=p.pool.size(),
            in_flight=p.tracker.in_flight("rollout"),
            errors=p.errors.recent(20),
            message=self.message or p.state.stop_reason,
            components=sorted(p.observer.components.values(), key=lambda c: (c.role, c.id)) if p.observer else [],
            history=list(p.memory.steps),
            timeline=sorted([*(p.observer.timeline if p.observer else ()), *p.state.milestones], key=lambda e: e["unix_ms"]),
            verdicts=p.fleet.verdicts_json(),
        )

    async def metrics_after(self, step: int):
        """(step, unix_ms, metrics) of every step after `step`, then new ones as
        they come, until the run ends."""
        p = self.pipeline
        if p is None:
            return
        while True:
            for item in p.memory.after(step):
                step = item[0]
                yield item
            if not self.active or p is not self.pipeline:
                return
            waiter = asyncio.ensure_future(p.memory.wait())
            finished = asyncio.ensure_future(asyncio.shield(self._task)) if self._task else None
            await asyncio.wait([w for w in (waiter, finished) if w], return_when=asyncio.FIRST_COMPLETED)
            for w in (waiter, finished):
                if w is not None and not w.done():
                    w.cancel()

    async def close(self) -> None:
        if self.active:
            await self.stop(checkpoint=False, grace_seconds=10)


async def _close(services: Services) -> None:
    if services.close is not None:
        try:
            await services.close()
        except Exception as exc:
            log.warning("closing connections: %s", exc)
