"""Weight export: the trainer's live parameters -> rollouts, in three methods.

* MEMORY: the state dict is encoded by the codec and streamed as bucketed,
  checksummed chunks to PushWeights of the trainer's own synchronizer
  (`sync.synchronizer_address`; FAILED_PRECONDITION without one).
* CHECKPOINT: a safetensors directory `<directory>/version_N/` (HF layout:
  config.json, *.safetensors, tokenizer, plus `weight_manifest.pb`) is
  written into a hidden temp sibling, fsynced and renamed, then registered
  with the synchronizer when `sync.synchronizer_address` is configured.
* NCCL: the trainer joins the transfer group the synchronizer allocated as
  rank 0 and broadcasts packed buckets (gloo on CPU), via
  `flywheel.synchronizer.participant.send_in_group`.

What is exported (`export_state`): the tensors of the model under the names
of the HF checkpoint it was loaded from (`from_pretrained` names; tied
duplicates such as `lm_head.weight` = `embed_tokens.weight` dropped, as
`save_pretrained` drops them), detached from autograd. With LoRA,
`merge_lora` exports those full weights with the adapters merged in (only
the adapted layers are computed as new tensors; the rest are the live
storage); without it, only the adapter weights (peft names). Without LoRA,
`merge_lora` changes nothing: the full weights are what there is. With
`model.publish_dtype` (float32 master weights served in bfloat16, say), the
floating tensors are cast to it: a new copy, in that dtype, is what goes out,
and its digests and probe are of the cast tensors.

Consistency without a second copy of the model: the codec hashes every chunk
up front and then streams the bytes straight from each tensor's own memory,
so the parameters must not change until the last byte has left. Copying
them out first would double the model's memory, so instead the engine's
training lock is held for the whole export: a training step waits for it
(it would have to anyway for a consistent version), while GetInfo and health
checks, which never take that lock, keep answering. The policy is switched to
eval mode for the duration and back to train mode after. Hashing runs in a
worker thread; the push stream builds one frame (one chunk copy, <= 4 MiB) at
a time on the event loop, so other RPCs interleave between chunks.

A sharded policy (`parallel`) exports the same names and bytes: rank 0
gathers them from the ranks one parameter at a time onto its host
(`distributed.gather_buckets`), still under the training lock.

Every version goes out with the trainer's probe of exactly those weights
(`services.trainer.probe`, computed inside the snapshot, beside the encoding or
the broadcast) and its tensors'
identity digests: in the pushed manifest (MEMORY), in the registration and the
directory's `weight_manifest.pb` (CHECKPOINT: a replica loading the directory
without a synchronizer has them too), in rank 0's success report (NCCL). The
synchronizer records them with the version; replicas verify against them.

Versions are monotonic at the synchronizer across methods: exporting the same
version twice, or by two methods, is refused there (FAILED_PRECONDITION),
except a CHECKPOINT registration retried with the same path.

Domain code: no grpc here beyond the synchronizer's typed client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from flywheel.codec import (
    DEFAULT_BUCKET_BYTES,
    MAX_CHUNK_BYTES,
    VersionIdentity,
    build_manifest,
    encode_state_dict,
    manifest_identity,
)
from flywheel.errors import FailedPrecondition, FlywheelError, InvalidArgument
from flywheel.probe import ProbeBatch
from flywheel.runtime.paths import confine
from flywheel.synchronizer.client import SynchronizerClient
from services.trainer.config import SyncConfig
from services.trainer.files import publish_dir, replace_directory, request_roots
from services.trainer.hf_save import save_hf
from services.trainer.policy import DTYPES, Policy
from services.trainer.probe import probe_token_ids, published_probe
from services.trainer.tied import drop_tied
from services.trainer.training import TrainingEngine

log = logging.getLogger(__name__)

#: Serialized WeightManifest of a checkpoint directory (read by the synchronizer and rollouts).
MANIFEST_FILE = "weight_manifest.pb"


@dataclass(frozen=True)
class ExportResult:
    weight_version: int
    #: Bytes sent (MEMORY, NCCL) or weight bytes written (CHECKPOINT).
    bytes: int
    duration_seconds: float
    #: The directory written (CHECKPOINT only).
    path: str = ""
    #: The version's identity (flywheel.codec.identity; b"" when none was made: a checkpoint of
    #: adapters, or without a manifest).
    identity: bytes = b""


# ---------------------------------------------------------------- what is exported


def export_state(policy: Policy, merge_lora: bool, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The detached tensors an export sends (see the module docstring); call it
    holding the engine's lock, and keep holding it while the result is used.
    `dtype` (model.publish_dtype): floating tensors cast to it, new tensors."""
    state = _live_state(policy, merge_lora)
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _live_state(policy: Policy, merge_lora: bool) -> dict[str, Tensor]:
    if policy.lora and not merge_lora:
        from peft import get_peft_model_state_dict

        # The adapters alone: an adapted output head tied to the embeddings would otherwise bring the whole
        # embedding matrix along (peft's "auto"), and an adapter is what rollouts serve beside others.
        # As a LoRA of the selected model's own rank and modules (Policy.set_shape).
        adapters = get_peft_model_state_dict(policy.model, save_embedding_layers=False)
        return policy.trim_to_shape({k: v.detach() for k, v in adapters.items()})
    with torch.no_grad():
        state = policy.hf_state_dict() if policy.lora else policy.model.state_dict()
    return drop_tied(policy.hf_model, {k: v.detach() for k, v in state.items()})


# ---------------------------------------------------------------- the lock


@contextlib.asynccontextmanager
async def _hold(lock: threading.Lock) -> AsyncIterator[None]:
    """Holds a threading lock from async code without blocking the event loop."""
    acquiring = asyncio.ensure_future(asyncio.to_thread(lock.acquire))
    try:
        await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        # The worker thread may still get the lock: give it back when it does.
        acquiring.add_done_callback(lambda f: lock.release() if not f.cancelled() and f.result() else None)
        raise
    try:
        yield
    finally:
        lock.release()


@contextlib.asynccontextmanager
async def _finished(work: asyncio.Future) -> AsyncIterator[None]:
    """Waits, on the way out, for `work` (a thread reading the weights) to end, whatever ended the block:
    the weights must not change under it."""
    try:
        yield
    finally:
        with contextlib.suppress(BaseException):
            await asyncio.shield(work)


@contextlib.contextmanager
def _eval_mode(policy: Policy) -> Iterator[None]:
    policy.model.eval()
    try:
        yield
    finally:
        policy.model.train()


# ---------------------------------------------------------------- the exporter


class WeightExporter:
    """Exports the engine's current weight version (blocking parts run in threads)."""

    def __init__(self, engine: TrainingEngine, sync: SyncConfig, token: str | None = None) -> None:
        self.engine = engine
        self.sync = sync
        self.token = token  # the deployment's bearer token: the synchronizer checks it like any service

    @property
    def _publish_dtype(self) -> torch.dtype | None:
        model = self.engine.config.model
        return None if model.publish_dtype in (None, model.dtype) else DTYPES[model.publish_dtype]

    def _client(self, address: str) -> SynchronizerClient:
        return SynchronizerClient(address, self.token, shared_memory=self.sync.shared_memory_push)

    @contextlib.asynccontextmanager
    async def _snapshot(
        self, merge_lora: bool
    ) -> AsyncIterator[tuple[int, dict[str, Tensor], asyncio.Future[ProbeBatch]]]:
        """(version, tensors, the probe of those tensors being computed), consistent and unchanging
        while the block runs. The probe (one forward: `services.trainer.probe`) runs beside what the
        block does with the tensors (encoding, broadcasting), and is over before the lock goes."""
        async with _hold(self.engine.lock):
            policy = self.engine.ready_policy()
            version = policy.weight_version
            if version < 1:
                raise FailedPrecondition(
                    "weight version 0 is the initial model (rollouts load it from model.path): "
                    "nothing to export before the first optimizer step"
                )
            if self.engine.sharded:
                # Gathered from the ranks one parameter at a time into this host's memory (one copy).
                state = await asyncio.to_thread(self.engine.gathered_state, DEFAULT_BUCKET_BYTES)
                ids = probe_token_ids(policy)
                probing = asyncio.ensure_future(asyncio.to_thread(
                    lambda: ProbeBatch.of(ids, self.engine.sharded_probe(ids))))
                async with _finished(probing):
                    yield version, state, probing
                return
            with _eval_mode(policy):
                state = await asyncio.to_thread(export_state, policy, merge_lora, self._publish_dtype)
                probing = asyncio.ensure_future(asyncio.to_thread(published_probe, policy, state, merge_lora))
                async with _finished(probing):
                    yield version, state, probing

    # -- MEMORY ------------------------------------------------------------

    async def memory(
        self, *, chunk_bytes: int = 0, bucket_bytes: int = 0, merge_lora: bool = False
    ) -> ExportResult:
        """Pushes the current version to the trainer's own synchronizer (`sync.synchronizer_address`)."""
        chunk_bytes = chunk_bytes or MAX_CHUNK_BYTES
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"memory.chunk_bytes: must be at most {MAX_CHUNK_BYTES}, got {chunk_bytes}")
        address = self.sync.synchronizer_address or ""
        if not address:
            raise FailedPrecondition(
                "MEMORY export goes to the trainer's own synchronizer: set sync.synchronizer_address in its config"
            )
        bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        started = time.perf_counter()
        async with self._client(address) as client, self._snapshot(merge_lora) as (version, state, probing):
            encoded = await asyncio.to_thread(
                encode_state_dict, state, version, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes
            )
            result = await client.push_weights(encoded, probe=await probing)
        duration = time.perf_counter() - started
        log.info("weights exported", extra={"method": "memory", "version": version, "bytes": result.nbytes,
                                            "seconds": round(duration, 3), "synchronizer": address})
        return ExportResult(version, result.nbytes, duration, identity=bytes(encoded.manifest.identity))

    # -- CHECKPOINT --------------------------------------------------------

    async def checkpoint(self, directory: str = "", *, merge_lora: bool = False) -> ExportResult:
        """Writes `<directory>/version_N` (default: `publish_dir`) and registers it with the synchronizer."""
        config = self.engine.config
        parent = confine(directory, request_roots(config), "directory") if directory else publish_dir(config)
        started = time.perf_counter()
        async with self._snapshot(merge_lora) as (version, state, probing):
            policy = self.engine.ready_policy()
            probe = await probing
            path, nbytes, identity = await asyncio.to_thread(
                write_version, policy, state, version, parent, merge_lora, probe)
        if self.sync.synchronizer_address:
            async with self._client(self.sync.synchronizer_address) as client:
                # Absolute: the synchronizer takes a relative path inside its own checkpoint_root.
                await client.register_checkpoint(version, str(path.absolute()), self.sync.trainer_id,
                                                  tensors=identity.tensors, probe=probe)
        duration = time.perf_counter() - started
        log.info("weights exported", extra={"method": "checkpoint", "version": version, "bytes": nbytes,
                                            "seconds": round(duration, 3), "path": str(path)})
        return ExportResult(version, nbytes, duration, str(path), identity.digest)

    # -- NCCL --------------------------------------------------------------

    async def nccl(self, group_id: str, *, bucket_bytes: int = 0, merge_lora: bool = False) -> ExportResult:
        from flywheel.synchronizer.participant import send_in_group
        from flywheel.synchronizer.types import TransferState

        if not group_id:
            raise InvalidArgument("nccl.group_id: empty")
        address = self.sync.synchronizer_address
        if not address:
            raise FailedPrecondition("NCCL export needs the trainer's sync.synchronizer_address (set it in the config)")
        started = time.perf_counter()
        async with self._client(address) as client:
            group = (await client.get_transfer(group_id)).group
            if group is None:
                raise FailedPrecondition(f"nccl.group_id: the synchronizer knows no group {group_id!r}")
            rank0 = [c for c, r in group.ranks.items() if r == 0]
            trainer_id = self.sync.trainer_id if self.sync.trainer_id in group.ranks else (rank0[0] if rank0 else "")
            try:
                async with self._snapshot(merge_lora) as (version, state, probing):
                    if version != group.version:
                        raise FailedPrecondition(
                            f"nccl.group_id: group {group_id!r} transfers version {group.version}, "
                            f"the trainer holds version {version}"
                        )
                    outcome = await send_in_group(
                        client, trainer_id, group, state, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                        probe=probing,  # reported after the broadcast: it runs beside it
                    )
                    nbytes = sum(t.numel() * t.element_size() for t in state.values())
            except FlywheelError as exc:
                # The broadcast never started: fail the transfer now rather than
                # leave the receivers waiting for its deadline.
                with contextlib.suppress(FlywheelError):
                    await client.report_transfer(group_id, trainer_id, False, str(exc))
                raise
        if outcome.state != TransferState.COMMITTED:
            raise FailedPrecondition(
                f"NCCL transfer {group_id} of version {version} ended {outcome.state.name}: {outcome.error}"
            )
        duration = time.perf_counter() - started
        log.info("weights exported", extra={"method": "nccl", "version": version, "bytes": nbytes,
                                            "seconds": round(duration, 3), "group": group_id})
        return ExportResult(version, nbytes, duration, identity=outcome.identity)


# ---------------------------------------------------------------- CHECKPOINT files


def _safetensors_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            names.extend(fh.keys())
    return names


def write_adapter(policy: Policy, state: dict[str, Tensor], directory: Path) -> None:
    """The selected model's adapters `state` (`export_state`) as peft writes an adapter: adapter_config.json
    (the trainer's LoRA settings with the model's own rank and modules) and adapter_model.safetensors."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    config = dataclasses.replace(policy.model.peft_config["default"], r=policy.shape.rank,
                                 target_modules=set(policy.shape.modules))
    config.save_pretrained(str(directory))
    save_file(state, str(directory / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})


def write_version(
    policy: Policy, state: dict[str, Tensor], version: int, parent: Path, merge_lora: bool,
    probe: ProbeBatch | None = None,
) -> tuple[Path, int, VersionIdentity]:
    """Writes `parent/version_<version>` atomically, `probe` in its weight manifest; returns (path,
    weight bytes, identity with each tensor's digest: empty without a weight manifest)."""
    parent.mkdir(parents=True, exist_ok=True)
    name = f"version_{version}"
    for stale in parent.glob(f".tmp-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-export
    final = parent / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
    try:
        if policy.lora and not merge_lora:
            write_adapter(policy, state, tmp)
        else:
            if policy.sharded:
                save_hf(policy.hf_model, tmp, state)
            else:
                policy.hf_model.save_pretrained(tmp, state_dict=state)
            if policy.tokenizer is not None:
                policy.tokenizer.save_pretrained(tmp)
        names = _safetensors_names(tmp)
        identity = VersionIdentity(b"")
        if set(names) == set(state):
            # Binds every byte to the version (the synchronizer and rollouts verify it).
            manifest = build_manifest({n: state[n] for n in names}, version)
            if probe is not None:
                manifest.probe.CopyFrom(probe.to_pb())
            (tmp / MANIFEST_FILE).write_bytes(manifest.SerializeToString())
            identity = manifest_identity(manifest) or identity
        else:
            log.warning("export: the written tensors differ from the exported ones; no weight manifest",
                        extra={"path": str(final)})
        nbytes = sum(state[n].numel() * state[n].element_size() for n in names if n in state)
        replace_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, nbytes, identity
