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

from flywheel.synchronizer.client_types import DeltaBase, PullStats
from services.rollout.engine.base import MemorySource, StagedWeights, TensorSpec, engine_pulls_memory
from services.rollout.engine.pull import pull_tensors


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
