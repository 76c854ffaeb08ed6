"""A MEMORY version pulled from the synchronizer into CPU tensors, refused
before any chunk arrives if the engine cannot serve it. It runs in the
rollout service (`services.rollout.weights.sources`) and, for an engine that
pulls versions itself, in that engine's worker process (vLLM's), which is
why it lives with the engines: the one module of `engine/` that reaches the
synchronizer, through its typed client."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flywheel.runtime.tls import TlsFiles
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import DeltaBase, PulledWeights
from services.rollout.engine.base import TensorSpec
from services.rollout.engine.checkpoint import check_stream_manifest


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
    retry_unreached: bool = True,
) -> PulledWeights:
    """Version `version` from the synchronizer at `address`, every chunk checksum
    and the version's digest verified, in CPU tensors: `staging` (tensors of
    exactly `want`'s names, dtypes and shapes, overwritten) or fresh ones.
    `tls`: the TLS to call with (default: this process's). The synchronizer's
    refusals raise their domain errors, status kept (NOT_FOUND: evicted by a
    newer push). `base`: a verified version held here, to be sent a delta from.
    `compress`: ask for compressed chunks (None: when the link proved slow).
    `retry_unreached` False: a source that cannot be reached fails at once (a
    nearby one, with the synchronizer to fall back on)."""
    # A client (and channel) per pull: the address is the request's, and the
    # vLLM worker pulls from its own process.
    async with SynchronizerClient(address, token, timeout=timeout, transfer_timeout=timeout,
                                  max_message_bytes=max_message_bytes, tls=tls, compress=compress,
                                  retry_unavailable=retry_unreached) as client:
        return await client.pull_weights(
            version, staging=staging, timeout=timeout, base=base, retry_unreached=retry_unreached,
            check_manifest=lambda m: check_stream_manifest(version, m, want),
        )
