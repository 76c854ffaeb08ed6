"""When a MEMORY update asks for a delta (`updates.delta_pulls`).

A replica far from the synchronizer (another host, a remote site) pays for
every byte of a version on its link; one step of fine-tuning changes a few
percent of a bfloat16 model, so it asks for the next version as a delta from
the one it serves (`flywheel.synchronizer.pull`). The base is the engine's
own weights, read in place (`Engine.host_weights`): no second copy is kept.
It is offered under the identity the last update verified on the resident
weights, so a base that drifted since, or a synchronizer that no longer holds
it, costs a full pull, never a wrong model: the rebuilt version is verified
against its identity before anything loads, and a failed delta is pulled
again in full.

A replica on the synchronizer's host reads versions in place from shared
memory, where a delta saves nothing and costs an apply: `auto` asks for
deltas only from a synchronizer whose last pull came over the stream.
"""

from __future__ import annotations

from typing import Literal

from flywheel.codec.identity import VersionIdentity
from flywheel.synchronizer.client_types import DeltaBase, PullStats
from services.rollout.engine.base import Engine

DeltaMode = Literal["auto", "on", "off"]


class DeltaPolicy:
    def __init__(self, mode: DeltaMode) -> None:
        self.mode = mode
        #: Synchronizer address -> whether its last pull came over the stream (not shared memory).
        self._far: dict[str, bool] = {}

    def base(self, address: str, engine: Engine, served_identity: bytes) -> DeltaBase | None:
        """What to offer as the base of the next pull from `address` (None: pull in full)."""
        if self.mode == "off" or (self.mode == "auto" and not self._far.get(address, False)):
            return None
        if len(served_identity) != 16 or engine.version < 1:
            return None  # the served weights were never verified as a version
        tensors = engine.host_weights()
        if tensors is None:
            return None
        return DeltaBase(engine.version, VersionIdentity(served_identity), tensors)

    def observe(self, address: str, stats: PullStats | None) -> None:
        if stats is not None and (stats.stream_bytes or stats.shared_bytes):
            self._far[address] = stats.shared_bytes == 0
