"""Where per-step metrics go: JSONL, TensorBoard, W&B, Prometheus, memory.

`MetricsLog.write(step, metrics)` fans one step's metrics out to every sink.
A sink that fails is reported once as a warning and then skipped: losing a
dashboard must not stop training. `MemorySink` keeps the history for the
controller's Status and StreamMetrics RPCs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step: {"step", "unix_ms", ...metrics}."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "unix_ms": int(time.time() * 1000), **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer = SummaryWriter(str(directory))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, run_name: str, config: dict[str, Any]) -> None:
        import wandb  # optional dependency

        self._run = wandb.init(project=project, name=run_name, config=config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MemorySink:
    """Recent steps in memory, with waiting for new ones (StreamMetrics)."""

    def __init__(self, keep: int = 10_000) -> None:
        self.keep = keep
        self.steps: list[tuple[int, int, dict[str, float]]] = []
        self._changed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append((step, int(time.time() * 1000), dict(metrics)))
        del self.steps[: -self.keep]
        event, self._changed = self._event(), asyncio.Event()
        event.set()

    def latest(self) -> dict[str, float]:
        return self.steps[-1][2] if self.steps else {}

    def after(self, step: int) -> list[tuple[int, int, dict[str, float]]]:
        return [s for s in self.steps if s[0] > step]

    async def wait(self) -> None:
        await self._event().wait()

    def close(self) -> None:
        if self._changed is not None:
            self._changed.set()


class PrometheusSink:
    """Sets the controller's Prometheus families from each step's metrics."""

    def __init__(self) -> None:
        from services.controller.telemetry import metrics as prom

        self.prom = prom

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.prom.update_from_step(metrics)

    def observe_staleness(self, values: list[int]) -> None:
        self.prom.observe_staleness(values)

    def close(self) -> None:
        pass


class MetricsLog:
    def __init__(self, sinks: list[MetricsSink] | None = None) -> None:
        self.sinks: list[MetricsSink] = list(sinks or [])
        self._failed: set[int] = set()

    def add(self, sink: MetricsSink) -> None:
        self.sinks.append(sink)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for i, sink in enumerate(self.sinks):
            if i in self._failed:
                continue
            try:
                sink.write(step, metrics)
            except Exception as exc:  # a dashboard outage must not stop training
                self._failed.add(i)
                log.warning("metrics sink %s failed, disabled: %s", type(sink).__name__, exc)

    def observe_staleness(self, values: list[int]) -> None:
        """Per-sample staleness of a trained batch, for sinks that keep histograms."""
        for sink in self.sinks:
            observe = getattr(sink, "observe_staleness", None)
            if observe is not None:
                observe(values)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("closing metrics sink %s: %s", type(sink).__name__, exc)
