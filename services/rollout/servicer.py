"""gRPC servicer of the rollout service: translates protobuf to the domain.

RPCs not overridden here answer UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.rollout.v1 import rollout_pb2_grpc as pb_grpc
from services.rollout.config import RolloutConfig


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, config: RolloutConfig) -> None:
        self.config = config

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        # No engine runs yet: engines arrive with the rollout issue.
        return pb.GetStatusResponse(
            model_name=str(self.config.engine.model_path or ""),
            weight_version=0,
            engine="none",
            paused=False,
        )
