"""gRPC servicer of the controller: translates protobuf to the domain.

RPCs not overridden here answer UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

from flywheel.controller.v1 import controller_pb2 as pb
from flywheel.controller.v1 import controller_pb2_grpc as pb_grpc


class ControllerServicer(pb_grpc.ControllerServiceServicer):
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        # No run can be started yet: the pipeline arrives with the controller issue.
        return pb.StatusResponse(phase=pb.RUN_PHASE_IDLE)
