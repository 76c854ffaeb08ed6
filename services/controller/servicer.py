"""gRPC servicer of the controller: translates protobuf to the run manager.

Start parses and validates the YAML (INVALID_ARGUMENT naming the field),
refuses a second concurrent run (FAILED_PRECONDITION); Stop asks the loop to
stop, optionally after a checkpoint; Status reports the live pipeline;
Status carries every component as the synchronizer sees it; StreamMetrics replays the steps after `after_step` and follows new ones
until the run ends.
"""

from __future__ import annotations

from flywheel.common.v1 import common_pb2 as cpb
from flywheel.controller.v1 import controller_pb2 as pb
from flywheel.controller.v1 import controller_pb2_grpc as pb_grpc
from flywheel.synchronizer.convert import component_to_pb
from services.controller.ops.runs import RunManager

PHASES = {
    "idle": pb.RUN_PHASE_IDLE,
    "starting": pb.RUN_PHASE_STARTING,
    "running": pb.RUN_PHASE_RUNNING,
    "stopping": pb.RUN_PHASE_STOPPING,
    "completed": pb.RUN_PHASE_COMPLETED,
    "failed": pb.RUN_PHASE_FAILED,
}
MODES = {"sync": pb.RUN_MODE_SYNC, "fully-async": pb.RUN_MODE_FULLY_ASYNC, "batch-async": pb.RUN_MODE_BATCH_ASYNC}


def _metrics(values: dict[str, float]) -> list[cpb.Metric]:
    return [cpb.Metric(name=k, value=v) for k, v in values.items()]


class ControllerServicer(pb_grpc.ControllerServiceServicer):
    def __init__(self, runs: RunManager) -> None:
        self.runs = runs

    async def Start(self, request: pb.StartRequest, context) -> pb.StartResponse:
        run_id, run_dir = await self.runs.start(request.config_yaml, request.run_id)
        return pb.StartResponse(run_id=run_id, run_dir=str(run_dir))

    async def Stop(self, request: pb.StopRequest, context) -> pb.StopResponse:
        path = await self.runs.stop(checkpoint=request.checkpoint, grace_seconds=request.grace_seconds or 30.0)
        return pb.StopResponse(checkpoint_path=path)

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        s = self.runs.status()
        return pb.StatusResponse(
            run_id=s.run_id,
            phase=PHASES[s.phase],
            mode=MODES.get(s.mode, pb.RUN_MODE_UNSPECIFIED),
            step=s.step,
            total_steps=s.total_steps,
            trainer_version=s.trainer_version,
            metrics=_metrics(s.metrics),
            pool_size=s.pool_size,
            in_flight=s.in_flight,
            errors=[
                pb.RunError(module=e.module, severity=e.severity, message=e.message, context=str(e.context), unix_ms=e.unix_ms)
                for e in s.errors
            ],
            components=[component_to_pb(c) for c in s.components],
            message=s.message,
        )

    async def StreamMetrics(self, request: pb.StreamMetricsRequest, context):
        async for step, unix_ms, metrics in self.runs.metrics_after(request.after_step):
            yield pb.StreamMetricsResponse(step=step, metrics=_metrics(metrics), unix_ms=unix_ms)
