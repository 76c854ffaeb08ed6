"""The synchronizer as a weight source: one MEMORY version pulled through
its typed client (`flywheel.synchronizer.client`, the rollout's one way to
reach it) and assembled (`flywheel.synchronizer.pull`: in place from shared
memory when the synchronizer is on this host, else over the stream), refused
before any chunk arrives if the engine cannot serve it. An engine that pulls
versions itself (the vLLM engine, in its worker) is handed where the version
is instead."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping

import torch

from flywheel.runtime.tls import TlsFiles
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import DeltaBase, PulledWeights, PullStats
from services.rollout.engine.base import MemorySource, StagedWeights, TensorSpec, engine_pulls_memory
from services.rollout.weights.verify import check_stream_manifest


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
    base: DeltaBase | None = None,
    compress: bool | None = None,
) -> PulledWeights:
    """Version `version` from the synchronizer at `address`, every chunk checksum
    and the version's digest verified, in CPU tensors: `staging` (tensors of
    exactly `want`'s names, dtypes and shapes, overwritten) or fresh ones.
    `tls`: the TLS to call with (default: this process's). The synchronizer's
    refusals raise their domain errors, status kept (NOT_FOUND: evicted by a
    newer push). `base`: a verified version held here, to be sent a delta from.
    `compress`: ask for compressed chunks (None: when the link proved slow)."""
    # A client (and channel) per pull: the address is the request's, and the
    # vLLM worker pulls from its own process.
    async with SynchronizerClient(address, token, timeout=timeout, transfer_timeout=timeout,
                                  max_message_bytes=max_message_bytes, tls=tls, compress=compress) as client:
        return await client.pull_weights(
            version, staging=staging, timeout=timeout, base=base,
            check_manifest=lambda m: check_stream_manifest(version, m, want),
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
    base: DeltaBase | None = None,
    on_pulled: Callable[[PullStats | None], None] | None = None,
    compress: bool | None = None,
) -> StagedWeights:
    """Version `version` as `pull_tensors` stages it; or, while an engine that
    pulls versions itself is being updated, only where it is (`source`).
    `on_pulled` is told what the pull cost."""
    if engine_pulls_memory.get():
        source = MemorySource(address, version, token, timeout, max_message_bytes, ticket=uuid.uuid4().hex)
        return StagedWeights(version=version, source=source)
    pulled = await pull_tensors(address, version, want, token=token, timeout=timeout,
                                max_message_bytes=max_message_bytes, staging=staging, base=base, compress=compress)
    if on_pulled is not None:
        on_pulled(pulled.stats)
    return StagedWeights(version=version, tensors=pulled.tensors, nbytes=pulled.nbytes, identity=pulled.identity)
