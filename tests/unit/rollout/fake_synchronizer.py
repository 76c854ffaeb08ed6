"""TEST DOUBLE of the synchronizer: a real gRPC server implementing only
`SynchronizerService.PullWeights`, serving weight versions encoded from state
dicts. It can corrupt one chunk's bytes or stop the stream early, so tests
can show the rollout refuses bad transfers. Not the product synchronizer."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
import torch

from flywheel.codec import encode_state_dict
from flywheel.synchronizer.v1 import synchronizer_pb2 as pb
from flywheel.synchronizer.v1 import synchronizer_pb2_grpc as pb_grpc


class FakeSynchronizer(pb_grpc.SynchronizerServiceServicer):
    def __init__(self) -> None:
        self.versions: dict[int, object] = {}
        #: version -> chunk sequence whose payload gets one byte flipped.
        self.corrupt: dict[int, int] = {}
        #: version -> number of chunks sent before the stream just ends.
        self.truncate: dict[int, int] = {}
        #: version -> seconds to stall before the first chunk.
        self.stall: dict[int, float] = {}
        self.pulls: list[int] = []
        self._server: grpc.aio.Server | None = None
        self.address = ""

    def add(self, version: int, state: Mapping[str, torch.Tensor], chunk_bytes: int = 64 * 1024) -> None:
        self.versions[version] = encode_state_dict(dict(state), version, chunk_bytes=chunk_bytes)

    async def PullWeights(self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext):
        self.pulls.append(request.version)
        encoded = self.versions.get(request.version)
        if encoded is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {request.version} not held")
        yield pb.PullWeightsResponse(manifest=encoded.manifest)
        if request.version in self.stall:
            await asyncio.sleep(self.stall[request.version])
        for chunk in encoded.chunks():
            if chunk.sequence == self.truncate.get(request.version, -1):
                return
            if chunk.sequence == self.corrupt.get(request.version, -1):
                chunk = type(chunk).FromString(chunk.SerializeToString())
                data = bytearray(chunk.data)
                data[len(data) // 2] ^= 0x01
                chunk.data = bytes(data)
            yield pb.PullWeightsResponse(chunk=chunk)

    async def start(self) -> str:
        self._server = grpc.aio.server()
        pb_grpc.add_SynchronizerServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
