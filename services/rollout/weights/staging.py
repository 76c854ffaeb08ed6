"""Staging tensors a rollout reuses from one MEMORY update to the next.

A pull assembles the version in CPU staging tensors. Fresh ones cost a
model's worth of page faults every update: about three times the CPU of the
pull itself (1 GiB on two cores: 0.9 CPU-s instead of 0.28, 0.48 s instead
of 0.15). Once an update is over its staging tensors are free (an engine
copies them into its weights, or, as the transformers engine does, takes
them in place of its own and hands its previous tensors back in the same
dict), and the next version (the same names, dtypes and shapes: the served
model's) is staged into them. Updates run one at a time
(`RolloutCore`), so one set is enough.

The price is memory: the set stays with the process between updates (the
same peak an update reaches anyway). `updates.reuse_staging: false` hands
it back after every update instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.rollout.engine.base import TensorSpec


class StagingBuffers:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._free: dict[str, torch.Tensor] | None = None

    def take(self, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor] | None:
        """The free set if it fits `specs` exactly (it is then the caller's), else None."""
        free, self._free = self._free, None
        if free is None or free.keys() != specs.keys():
            return None
        for name, spec in specs.items():
            t = free[name]
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                return None
        return free

    def give_back(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keeps `tensors` for the next update; the caller must not read or write them any more."""
        if self.enabled:
            self._free = tensors

    @property
    def held_bytes(self) -> int:
        """Bytes of the free set (0 while an update holds it, or when disabled)."""
        return sum(t.nbytes for t in self._free.values()) if self._free else 0
