"""The one door a new weight version comes in by, whoever asked for it: an
operator's UpdateWeights (the servicer translates it into a `Source`) or the
follower moving the replica as the synchronizer's policy says.

`WeightArrival.install` picks how the bytes come (`Source`), asks the
synchronizer what the version is (its recorded identity, each tensor's
digest and the trainer's probe: what the update is verified against) and
runs the update transaction (`services.rollout.weights.transaction`):

- `FromSynchronizer` (MEMORY): pulled from the synchronizer, or first from a
  relay or a peer replica of this replica's site that holds it (the
  synchronizer's registry names them; a nearby source that cannot serve it,
  or sends other bytes, is passed over);
- `FromCheckpoint` (CHECKPOINT): a directory inside `updates.checkpoint_root`;
- `FromBaseModel` (version 0, after the run started over): the engine's own
  model directory;
- `FromGroup` (NCCL/gloo): a broadcast in the synchronizer's transfer group
  (`services.rollout.weights.nccl`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from flywheel.errors import FailedPrecondition, NotFound
from flywheel.synchronizer.client import SynchronizerClient
from flywheel.synchronizer.client_types import VersionProof
from flywheel.synchronizer.types import Role, State
from services.rollout.config import RolloutConfig
from services.rollout.engine.base import PauseMode
from services.rollout.weights.nccl import NcclTarget, update_over_group
from services.rollout.weights.peers import peer_holding
from services.rollout.weights.sources import Stage, base_stage, checkpoint_stage, fallback_stage, memory_stage
from services.rollout.weights.transaction import UpdateResult, WeightUpdates

#: updates.compress_pulls -> what a pull asks for (None: the link decides, flywheel.synchronizer.pull).
COMPRESS = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class FromSynchronizer:
    """MEMORY: the synchronizer's copy (or a nearby one of the same bytes)."""


@dataclass(frozen=True)
class FromCheckpoint:
    #: A directory of safetensors files (with its weight_manifest.pb), inside updates.checkpoint_root.
    path: str


@dataclass(frozen=True)
class FromBaseModel:
    """Version 0: the directory the engine was started from."""


@dataclass(frozen=True)
class FromGroup:
    target: NcclTarget


Source = FromSynchronizer | FromCheckpoint | FromBaseModel | FromGroup


class WeightArrival:
    def __init__(self, updates: WeightUpdates, config: RolloutConfig, token: str | None) -> None:
        self.updates, self.config, self.token = updates, config, token
        #: The rollout's synchronizer, once its link is up (None: standalone, or not yet linked; MEMORY and
        #: NCCL updates are then refused) and this replica's id there.
        self.client: SynchronizerClient | None = None
        self.component_id = ""

    def attach(self, client: SynchronizerClient, component_id: str) -> None:
        """The synchronizer link is up (services.rollout.weights.link)."""
        self.client, self.component_id = client, component_id

    def detach(self) -> None:
        self.client = None

    async def install(self, version: int, source: Source, *, mode: PauseMode | None = None,
                      timeout: float | None = None, rewind: bool = False) -> UpdateResult:
        """Installs `version` from `source` (see the module docstring); `rewind`: in place of weights
        of a lineage the run abandoned, whatever their number."""
        timeout = timeout or self.config.updates.timeout_seconds
        if isinstance(source, FromGroup):
            self._require_client("an NCCL")
            return await update_over_group(self.updates, source.target, version, mode, timeout, token=self.token,
                                           rewind=rewind, proof=lambda: self.proof(version))
        if isinstance(source, FromSynchronizer):
            # A nearby source (a site's relay or peer) is judged by the version's record before its bytes load,
            # so the record is asked for first then. Otherwise only once the pull is done: the synchronizer's
            # own bytes are the version, and a version being published again (a rewind's, whose bytes were
            # evicted) has the record of what was published last only then.
            known = await self.proof(version) if self.config.synchronizer.site else None
            stage = await self._memory(version, timeout, known)
            later = (lambda: _now(known)) if known is not None else (lambda: self.proof(version))
            return await self.updates.run(version, stage, mode, timeout, rewind=rewind, proof=later)
        engine, _ = self.updates.core.require_engine()
        if isinstance(source, FromCheckpoint):
            stage = checkpoint_stage(source.path, version, engine.weight_specs(), self.config.updates.checkpoint_root)
        else:
            stage = base_stage(self.config.engine, engine.weight_specs())
        return await self.updates.run(version, stage, mode, timeout, rewind=rewind,
                                      proof=(lambda: self.proof(version)) if version else None)

    async def proof(self, version: int) -> VersionProof | None:
        """What the synchronizer recorded for `version` (None: standalone, or it has no record)."""
        if self.client is None:
            return None
        with contextlib.suppress(NotFound):
            return await self.client.get_version(version)
        return None

    def _require_client(self, what: str) -> SynchronizerClient:
        if self.client is None:
            raise FailedPrecondition(
                f"{what} update comes from this rollout's synchronizer, and it has none (synchronizer.address)")
        return self.client

    async def _memory(self, version: int, timeout: float, known: VersionProof | None) -> Stage:
        client = self._require_client("a MEMORY")
        engine, _ = self.updates.core.require_engine()
        updates, server = self.config.updates, self.config.server
        deltas, identity = self.updates.deltas, known.identity if known is not None else None

        def stage_from(address: str, nearby: bool = False) -> Stage:
            return memory_stage(address, version, engine.weight_specs(), token=self.token, timeout=timeout,
                                max_message_bytes=server.max_message_bytes, buffers=self.updates.staging,
                                identity=identity, base=deltas.base(address, engine, self.updates.identity),
                                on_pulled=lambda stats: deltas.observe(address, stats),
                                compress=COMPRESS[updates.compress_pulls], retry_unreached=not nearby)

        nearby = await self._nearby(client, version, known)
        if not nearby:
            return stage_from(client.address)
        return fallback_stage([*((kind, address, stage_from(address, nearby=True)) for kind, address in nearby),
                               ("synchronizer", client.address, lambda: stage_from(client.address)())])

    async def _nearby(self, client: SynchronizerClient, version: int,
                      known: VersionProof | None) -> list[tuple[str, str]]:
        """Sources of `version` at this replica's site, from the synchronizer's registry, to try
        before the synchronizer itself: a running relay of the site, then a peer replica that
        holds the version verified (services.rollout.weights.peers). Empty without a site."""
        site = self.config.synchronizer.site
        if not site:
            return []
        components = (await client.status()).components
        relays = sorted(c.identity.address for c in components
                        if c.role is Role.SYNCHRONIZER and c.state is State.RUNNING
                        and c.identity.labels.get("site") == site and c.identity.address)
        found = [("relay", relays[0])] if relays else []
        peer = peer_holding(components, site, version, known.identity.digest if known else b"", self.component_id)
        if peer is not None:
            found.append(("peer", peer))
        return found


async def _now(value: VersionProof | None) -> VersionProof | None:
    return value
