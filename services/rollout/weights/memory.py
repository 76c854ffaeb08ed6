"""The synchronizer as a weight source: one MEMORY version pulled and
assembled (`flywheel.synchronizer.pull`: in place from shared memory when
the synchronizer is on this host, else over the stream), refused before any
chunk arrives if the engine cannot serve it. An engine that pulls versions
itself (the vLLM engine, in its worker) is handed where the version is
instead."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import torch

from flywheel.common.v1 import common_pb2
from flywheel.runtime.client import open_channel, translated
from flywheel.runtime.tls import TlsFiles
from flywheel.synchronizer.pull import pull_version
from flywheel.synchronizer.v1 import synchronizer_pb2
from services.rollout.engine.base import MemorySource, StagedWeights, TensorSpec, engine_pulls_memory
from services.rollout.weights.verify import check_stream_manifest

_PULL = "/flywheel.synchronizer.v1.SynchronizerService/PullWeights"


async def pull_tensors(
    address: str,
    version: int,
    want: Mapping[str, TensorSpec],
    *,
    token: str | None,
    timeout: float,
    max_message_bytes: int,
    staging: dict[str, torch.Tensor] | None = None,
    tls: TlsFiles | None = None,
) -> tuple[common_pb2.WeightManifest, dict[str, torch.Tensor]]:
    """Version `version` from the synchronizer at `address`, every chunk checksum
    and the version's digest verified, in CPU tensors: `staging` (tensors of
    exactly `want`'s names, dtypes and shapes, overwritten) or fresh ones.
    `tls`: the TLS to call with (default: this process's)."""
    async with open_channel(address, token=token, default_timeout=timeout, max_message_bytes=max_message_bytes,
                            tls=tls) as channel:
        pull = channel.unary_stream(
            _PULL, request_serializer=synchronizer_pb2.PullWeightsRequest.SerializeToString, response_deserializer=None
        )
        # The synchronizer's refusals as domain errors, status kept (NOT_FOUND: evicted by a newer push).
        with translated(f"PullWeights from {address}"):
            return await pull_version(
                lambda request: pull(request, timeout=timeout),
                synchronizer_pb2.PullWeightsRequest(version=version),
                synchronizer=address,
                check_manifest=lambda m: check_stream_manifest(version, m, want),
                staging=staging,
            )


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
    """Version `version` as `pull_tensors` stages it; or, while an engine that
    pulls versions itself is being updated, only where it is (`source`)."""
    if engine_pulls_memory.get():
        source = MemorySource(address, version, token, timeout, max_message_bytes, ticket=uuid.uuid4().hex)
        return StagedWeights(version=version, source=source)
    manifest, tensors = await pull_tensors(address, version, want, token=token, timeout=timeout,
                                           max_message_bytes=max_message_bytes, staging=staging)
    return StagedWeights(version=version, tensors=tensors, nbytes=manifest.total_bytes)
