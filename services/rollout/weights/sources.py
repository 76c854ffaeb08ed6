"""Where a weight version comes from, as the `stage` callable that the update
transaction runs (`services.rollout.weights.transaction`): a CHECKPOINT
directory (verified in a thread), the engine's own model directory for
version 0 (the base model, when a run starts over), or the synchronizer's
MEMORY stream (pulled through its typed client and verified as it arrives,
read in place from shared memory on the synchronizer's host; an engine that
pulls versions itself, vLLM in its worker, is handed where the version is
instead). Each checks names, dtypes and shapes against the served model
before anything live is touched (`services.rollout.weights.verify`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from flywheel.runtime.paths import confine

from flywheel.codec import DigestMismatch
from flywheel.errors import Aborted, DataLoss, DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from flywheel.codec.identity import VersionIdentity
from flywheel.synchronizer.client_types import DeltaBase, PullStats
from services.rollout.config import EngineConfig
from services.rollout.engine.base import MemorySource, StagedWeights, TensorSpec, engine_pulls_memory
from services.rollout.engine.pull import pull_tensors
from services.rollout.weights.staging import StagingBuffers
from services.rollout.weights.transaction import Stage
from services.rollout.weights.verify import stage_checkpoint

log = logging.getLogger(__name__)


def checkpoint_stage(path: str, version: int, specs: Mapping[str, TensorSpec], root: Path | None) -> Stage:
    """`path` must lie inside `root` (updates.checkpoint_root), whoever sent it: an operator's UpdateWeights
    or the synchronizer's catalog. It is checked here, before the update starts."""
    directory = confine(path, [root] if root else [], "checkpoint.path")

    async def stage() -> StagedWeights:
        return await asyncio.to_thread(stage_checkpoint, directory, version, specs)

    return stage


def base_stage(engine: EngineConfig, specs: Mapping[str, TensorSpec]) -> Stage:
    """Version 0, the base model: the directory the engine was started from. The operator's
    configuration names it, so it is not confined to updates.checkpoint_root. Refused when that
    directory is not the base model (an engine started on a later version, `initial_version`)."""
    if engine.model_path is None:
        raise FailedPrecondition("the run starts over from the base model, and this replica has no engine.model_path")
    if engine.initial_version != 0:
        raise FailedPrecondition(
            f"the run starts over from the base model (version 0); this replica's engine.model_path holds version "
            f"{engine.initial_version} (engine.initial_version): restart it on the base model")
    directory = Path(engine.model_path)

    async def stage() -> StagedWeights:
        return await asyncio.to_thread(stage_checkpoint, directory, 0, specs)

    return stage


def memory_stage(
    address: str,
    version: int,
    specs: Mapping[str, TensorSpec],
    *,
    token: str | None,
    timeout: float,
    max_message_bytes: int,
    buffers: StagingBuffers | None = None,
    identity: VersionIdentity | None = None,
    base: DeltaBase | None = None,
    on_pulled: Callable[[PullStats | None], None] | None = None,
    compress: bool | None = None,
    retry_unreached: bool = True,
) -> Stage:
    """`buffers`: staged into the set they hold, if any, and given back on
    release; after a failed pull the set is dropped (fresh tensors next time).
    `identity`: the version's, as the synchronizer recorded it: a pull of other
    bytes under the number (a relay's or peer's) is refused before anything
    loads; the update verifies the engine against it.
    `base`: the served weights, offered as the base of a delta
    (`services.rollout.weights.deltas`); a delta that does not rebuild the
    version is pulled again in full. `on_pulled` is told what a pull cost.
    `compress`: ask for compressed chunks (None: when the link proved slow).
    `retry_unreached` False: a source that cannot be reached fails at once, for
    `fallback_stage` to ask the next (a gone peer cost a joining replica 36 s of
    retries before it asked the synchronizer)."""

    async def pulled(staging: dict[str, torch.Tensor] | None, delta_base: DeltaBase | None) -> StagedWeights:
        if engine_pulls_memory.get():
            # The engine pulls it itself, in its own process (vLLM's worker): only where it is goes there.
            source = MemorySource(address, version, token, timeout, max_message_bytes, ticket=uuid.uuid4().hex,
                                  retry_unreached=retry_unreached)
            return StagedWeights(version=version, source=source)
        got = await pull_tensors(address, version, specs, token=token, timeout=timeout,
                                 max_message_bytes=max_message_bytes, staging=staging, base=delta_base,
                                 compress=compress, retry_unreached=retry_unreached)
        if on_pulled is not None:
            on_pulled(got.stats)
        return StagedWeights(version=version, tensors=got.tensors, nbytes=got.nbytes, identity=got.identity)

    async def stage() -> StagedWeights:
        # Cancelling this (an abandoned update) cancels the pull.
        staging = buffers.take(specs) if buffers is not None else None
        try:
            staged = await pulled(staging, base)
        except DigestMismatch as exc:
            if base is None:
                raise
            log.warning("a delta from the served weights did not rebuild the version; pulling it in full",
                        extra={"version": version, "base_version": base.version, "error": str(exc)})
            staged = await pulled(None, None)
        if staged.identity is None:
            staged.identity = identity
        elif identity is not None and staged.identity.digest != identity.digest:
            # Consistent in itself, yet not the version the synchronizer recorded (a relay's or peer's
            # stream of other weights under the number): refused before anything loads.
            raise DigestMismatch(f"the weights pulled from {address} are not version {version}: identity "
                                 f"{staged.identity.hex[:16]}, recorded {identity.hex[:16]}")
        if buffers is not None and staged.tensors is not None:
            tensors = staged.tensors
            staged.release = lambda: buffers.give_back(tensors)
        return staged

    return stage


def fallback_stage(sources: Sequence[tuple[str, str, Stage]]) -> Stage:
    """The first of `sources` ((kind, address, stage): the site's relay, a peer, then the
    synchronizer) that serves the version: the next is asked when one is down or restarting,
    no longer has the version, fails to fetch it itself, or sends bytes that are not the version
    (a peer's or relay's stream proves nothing: the version's identity does)."""

    async def stage() -> StagedWeights:
        for kind, address, attempt in sources[:-1]:
            try:
                return await attempt()
            except (Unavailable, DeadlineExceeded, NotFound, Aborted, FailedPrecondition, DataLoss) as exc:
                log.warning("a nearby source could not serve the version; trying the next",
                            extra={"source": kind, "address": address, "error": str(exc)})
        return await sources[-1][2]()

    return stage
