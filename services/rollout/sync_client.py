"""The synchronizer as a weight source: one MEMORY version pulled and
assembled (`flywheel.synchronizer.pull`: in place from shared memory when
the synchronizer is on this host, else over the stream), refused before any
chunk arrives if the engine cannot serve it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flywheel.runtime.client import open_channel
from flywheel.synchronizer.v1 import synchronizer_pb2
from services.rollout.engine.base import StagedWeights, TensorSpec
from services.rollout.weights import check_stream_manifest
from flywheel.synchronizer.pull import pull_version

_PULL = "/flywheel.synchronizer.v1.SynchronizerService/PullWeights"


async def pull_staged(
    address: str,
    version: int,
    want: Mapping[str, TensorSpec],
    *,
    token: str | None,
    timeout: float,
    max_message_bytes: int,
    staging: dict[str, torch.Tensor] | None = None,
) -> StagedWeights:
    """Version `version` from the synchronizer at `address`, verified, in CPU
    tensors: `staging` (tensors of exactly `want`'s names, dtypes and shapes,
    overwritten) or fresh ones."""
    async with open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes) as channel:
        pull = channel.unary_stream(
            _PULL, request_serializer=synchronizer_pb2.PullWeightsRequest.SerializeToString, response_deserializer=None
        )
        manifest, tensors = await pull_version(
            lambda request: pull(request, timeout=timeout),
            synchronizer_pb2.PullWeightsRequest(version=version),
            synchronizer=address,
            check_manifest=lambda m: check_stream_manifest(version, m, want),
            staging=staging,
        )
    return StagedWeights(version=version, tensors=tensors, nbytes=manifest.total_bytes)
