"""The synchronizer as a weight source: `PullWeights` as a plain async stream
of `WeightManifest` then `WeightChunk` messages (transport only; verification
is `services.rollout.weights`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from flywheel.common.v1 import common_pb2
from flywheel.runtime.client import open_channel
from flywheel.synchronizer.v1 import synchronizer_pb2, synchronizer_pb2_grpc


async def pull_weights(
    address: str, version: int, *, token: str | None, timeout: float, max_message_bytes: int
) -> AsyncIterator[common_pb2.WeightManifest | common_pb2.WeightChunk]:
    """Yields the version's manifest, then its chunks, as the synchronizer sends them."""
    async with open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes) as channel:
        stub = synchronizer_pb2_grpc.SynchronizerServiceStub(channel)
        call = stub.PullWeights(synchronizer_pb2.PullWeightsRequest(version=version), timeout=timeout)
        try:
            async for response in call:
                kind = response.WhichOneof("payload")
                if kind == "manifest":
                    yield response.manifest
                elif kind == "chunk":
                    yield response.chunk
        finally:
            call.cancel()  # an abandoned update must not leave the transfer running
