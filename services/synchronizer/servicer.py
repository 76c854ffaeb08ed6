"""gRPC servicer of the synchronizer: translates protobuf to the domain.

RPCs not overridden here answer UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc


class SynchronizerServicer(pb_grpc.SynchronizerServiceServicer):
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        # Nothing registers yet: the registry arrives with the synchronizer issue.
        return pb.StatusResponse(latest_version=0)
