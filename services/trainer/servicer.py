"""gRPC servicer of the trainer: translates protobuf to the domain.

RPCs not overridden here answer UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

from flywheel.common.v1 import common_pb2
from flywheel.trainer.v1 import trainer_pb2 as pb
from flywheel.trainer.v1 import trainer_pb2_grpc as pb_grpc
from services.trainer.config import TrainerConfig

_DTYPES = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
}


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        model = self.config.model
        # No model is loaded yet: loading arrives with the trainer issue.
        return pb.GetInfoResponse(
            model_name=str(model.path or ""),
            dtype=_DTYPES[model.dtype],
            device=model.device,
            step=0,
            weight_version=0,
            ready=False,
        )
