"""The gateway's sampler: one rollout replica that serves the weights models
saved for sampling, side by side as adapters, or merged one version at a time.

A saved version is an identity, not a number: `SamplerVersion` is (model,
version, identity), where the identity is the one the trainer computed when it
exported the weights (flywheel.codec.identity, over every tensor's bytes).
The version number alone names nothing: two models' weights share numbers
(each model counts its own steps; a trainer that restarted counts from 1
again), so versions are kept, served and compared whole. Before a version is
loaded, the `weight_manifest.pb` of its directory must state that identity
(the replica then checks the files against the manifest, DATA_LOSS if they
differ); a sample is answered only if it came from the version its session is
pinned to: the replica served that (model, version, identity) throughout,
and every sample says it was made by that version number.

A save for the sampler exports the trainer's weights to a directory of its
own, `sampler_dir/<tenant>/<model id>/save-<id>/version_N` (two saves never
share one, whatever their numbers), in one of two ways:

* **Adapters**, when the replica serves LoRA adapters (its
  `adapters.max_resident`, stated in GetStatus): the model's adapter alone (a
  few MB), an immutable adapter the replica serves beside every other one on
  its unchanged base. A sample names its adapter (directory and identity); the
  replica loads it on first use, checks the identity of what it read, and
  stamps every sample with it; nothing pauses, nothing reloads the base, and
  tenants sample their own versions side by side.
* **Merged weights** otherwise: the replica holds one version at a time; a
  sample of another version waits for the samples running to finish, then
  the replica loads that version from its directory (going back to the base
  model first when the number is not above the one it serves).

Bounded: a model keeps its last `keep_unnamed` unnamed versions (what
save_weights_and_get_sampling_client makes at every RL step); older ones are
removed from disk, as are expired and deleted named ones. A session pinned to
a removed version is refused, naming why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from flywheel.common.v1 import common_pb2
from flywheel.errors import DataLoss, FailedPrecondition
from flywheel.rollout.client import RolloutClient
from flywheel.rollout.v1 import rollout_pb2
from services.tinker import metrics
from services.tinker.sampling import SamplePlan

log = logging.getLogger(__name__)

#: The manifest a checkpoint version's directory holds (services/trainer/export.py writes it).
MANIFEST_FILE = "weight_manifest.pb"


@dataclass(frozen=True)
class SamplerVersion:
    """Weights saved for sampling: whose, their number, their identity, where the replica loads them from."""

    tenant: str | None
    model_id: str | None  # None: the base model
    version: int
    identity: bytes  # 16 bytes (flywheel.codec.identity); empty for the base model
    checkpoint: str | None  # None: the base model
    name: str | None = None
    #: The checkpoint is the model's LoRA adapter, served on the base beside others (not merged weights).
    adapter: bool = False

    def describe(self) -> str:
        if self.model_id is None:
            return "the base model"
        return f"model {self.model_id} version {self.version} (identity {self.identity.hex()[:16]})"


BASE = SamplerVersion(None, None, 0, b"", None)


def manifest_identity(checkpoint: str) -> bytes:
    """The identity a version directory's manifest states."""
    try:
        manifest = common_pb2.WeightManifest.FromString((Path(checkpoint) / MANIFEST_FILE).read_bytes())
    except Exception as exc:  # noqa: BLE001 - OSError and protobuf's DecodeError
        raise DataLoss(f"{checkpoint}: its {MANIFEST_FILE} is unreadable ({exc})") from None
    return manifest.identity


class Sampler:
    """The replica and the versions saved for it; loads and samples take turns (see the module doc)."""

    def __init__(self, rollout: RolloutClient, timeout: float, keep_unnamed: int = 3) -> None:
        self.rollout = rollout
        self.timeout = timeout
        self.keep_unnamed = keep_unnamed
        #: What the replica serves; None until known (a gateway that restarted does not know what it loaded).
        self.serving: SamplerVersion | None = None
        #: Whether the replica serves adapters beside one another (then saves export adapters).
        self.adapters = False
        self._saved: set[SamplerVersion] = {BASE}
        self._running = 0  # samples in flight
        self._loading: SamplerVersion | None = None
        self._turns = asyncio.Condition()

    async def start(self) -> int:
        """The version the replica serves (a replica that answers is loaded: it serves after loading)."""
        status = await self.rollout.status()
        version = int(status.weight_version)
        self.serving = BASE if version == 0 else None
        self.adapters = status.max_resident_adapters > 0
        metrics.SAMPLER_VERSION.set(version)
        return version

    def saved(self, weights: SamplerVersion) -> bool:
        return weights in self._saved

    def adopt(self, weights: SamplerVersion) -> None:
        """Records a version saved before this gateway started (loaded when first sampled)."""
        self._saved.add(weights)

    def of_model(self, model_id: str) -> list[SamplerVersion]:
        return [w for w in self._saved if w.model_id == model_id]

    def newest(self, model_id: str, at_least: SamplerVersion) -> SamplerVersion:
        """`model_id`'s newest saved version numbered from `at_least`'s on (itself if none is newer)."""
        newer = [w for w in self._saved if w.model_id == model_id and w.version > at_least.version]
        return max(newer, key=lambda w: w.version) if newer else at_least

    def named(self, tenant: str, model_id: str, name: str) -> SamplerVersion | None:
        return next((w for w in self._saved if (w.tenant, w.model_id, w.name) == (tenant, model_id, name)), None)

    async def install(self, weights: SamplerVersion) -> list[SamplerVersion]:
        """Records `weights` and serves them from now on, once the samples running finish; then removes
        the model's unnamed versions past the last `keep_unnamed`. Returns those removed."""
        stated = manifest_identity(weights.checkpoint or "")
        if stated != weights.identity:
            raise DataLoss(f"{weights.checkpoint}: the manifest states identity {stated.hex()}, the trainer "
                           f"exported {weights.identity.hex()}")
        self._saved.add(weights)
        if not weights.adapter:  # an adapter is loaded by the replica when first sampled, beside the others
            async with self._turns:
                await self._serve(weights)
        unnamed = sorted((w for w in self._saved if w.model_id == weights.model_id and w.name is None),
                         key=lambda w: w.version)
        old = unnamed[:max(0, len(unnamed) - self.keep_unnamed)]
        for stale in old:
            await self.remove(stale, "unnamed")
        return old

    async def remove(self, weights: SamplerVersion, reason: str) -> None:
        """Forgets `weights` and removes its directory (not while the replica loads it)."""
        async with self._turns:
            await self._turns.wait_for(lambda: self._loading != weights)
            self._saved.discard(weights)
        if weights.checkpoint is not None:  # its save's own directory: save-<id>/version_N
            await asyncio.to_thread(shutil.rmtree, Path(weights.checkpoint).parent, True)
        metrics.SAMPLER_SAVES_REMOVED.labels(reason).inc()
        log.info("sampler weights removed", extra={"weights": weights.describe(), "reason": reason})

    async def _serve(self, weights: SamplerVersion) -> None:
        """Makes the replica serve `weights` (call it holding `_turns`); returns holding it again."""
        await self._turns.wait_for(lambda: self._loading is None)
        if self.serving == weights:
            return
        if weights not in self._saved:
            raise FailedPrecondition(f"{weights.describe()} is no longer saved for sampling (a model keeps its "
                                     f"last {self.keep_unnamed} unnamed saves; named ones until deleted or expired)")
        self._loading = weights
        await self._turns.wait_for(lambda: self._running == 0)
        self._turns.release()  # samples of other versions queue on `_loading` meanwhile
        try:
            if weights.version == 0 or self.serving is None or weights.version <= self.serving.version:
                await self.rollout.update_weights(0, start_over=True, timeout_seconds=self.timeout)
                self.serving = BASE
            if weights.version:
                await self.rollout.update_weights(weights.version, checkpoint=weights.checkpoint,
                                                  timeout_seconds=self.timeout)
                self.serving = weights
            metrics.SAMPLER_VERSION.set(weights.version)
        except BaseException:
            self.serving = None  # unknown: the next sample loads what it needs from the start
            raise
        finally:
            await self._turns.acquire()
            self._loading = None
            self._turns.notify_all()

    @contextlib.asynccontextmanager
    async def _serving(self, weights: SamplerVersion) -> AsyncIterator[None]:
        async with self._turns:
            while self.serving != weights or self._loading is not None:
                await self._serve(weights)
            self._running += 1
        try:
            yield
        finally:
            async with self._turns:
                self._running -= 1
                self._turns.notify_all()

    async def sample(self, plan: SamplePlan, pinned: SamplerVersion, exact: bool) -> list[common_pb2.Sample]:
        """Samples `pinned` (exact), or its model's newest saved version from `pinned` on."""
        weights = pinned if exact or pinned.model_id is None else self.newest(pinned.model_id, pinned)
        if weights not in self._saved:
            raise FailedPrecondition(f"{weights.describe()} is not saved for sampling here (removed, or the gateway "
                                     "restarted since): save the weights for the sampler again")
        if weights.adapter:
            return await self._sample_adapter(plan, weights)
        async with self._serving(weights):
            [samples] = await self.rollout.generate([plan.prompt], timeout=self.timeout, **plan.params)
            served = self.serving  # nothing loads while a sample runs: what served it throughout
        made_by = {(s.weight_version_start, s.weight_version_end) for s in samples}
        if served != weights or made_by != {(weights.version, weights.version)} or any(s.adapter_identity
                                                                                       for s in samples):
            raise FailedPrecondition(f"the sampler answered with weight versions {sorted(made_by)} of "
                                     f"{served.describe() if served else 'unknown weights'}, not "
                                     f"{weights.describe()} throughout")
        return list(samples)

    async def _sample_adapter(self, plan: SamplePlan, weights: SamplerVersion) -> list[common_pb2.Sample]:
        """Samples `weights`, an adapter, on the base model beside every other adapter (no turns: nothing
        is loaded in place). Answered only if every sample says it was drawn with that adapter, as the
        replica measured it, on the base model (version 0) throughout."""
        adapter = rollout_pb2.Adapter(path=weights.checkpoint or "", identity=weights.identity)
        async with self._serving(BASE):  # the base, which an adapter sits on, stays loaded meanwhile
            [samples] = await self.rollout.generate([plan.prompt], timeout=self.timeout, adapter=adapter,
                                                    **plan.params)
        drawn = {(bytes(s.adapter_identity), s.weight_version_start, s.weight_version_end) for s in samples}
        if drawn != {(weights.identity, 0, 0)}:
            raise FailedPrecondition(
                f"the sampler answered with adapters and base versions {sorted((i.hex()[:16], a, b) for i, a, b in drawn)}, "
                f"not {weights.describe()} on the base model throughout")
        return list(samples)
