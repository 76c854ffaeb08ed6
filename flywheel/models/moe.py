"""Mixture-of-experts routing: find a model's routers, record the experts they
choose, and replay recorded choices.

A router (transformers' `*TopKRouter`: Qwen3-MoE, OLMoE, Qwen2-MoE, ...) maps
each token's hidden state to logits over the layer's experts and keeps the
top_k. Tiny numeric differences between a rollout engine and the trainer
(float32 against bfloat16 autocast, other kernels, other batch shapes) flip
some of those picks, and the trainer's log-prob of a sampled token is then
computed through other experts than the sampler used. Routing replay (R3,
"rollout routing replay") removes that: the engine records the ids it chose
(`Recorder`), the sample carries them, and the trainer's forward
(`Replay`) uses the recorded ids in place of its own top-k, with the gate
weights still computed from its own logits (softmax over its logits, taken at
the recorded ids, renormalised as the model does), so the router still learns.

Routing is laid out per position of a sequence: `[T, L, K]` (positions,
MoE layers in model order, the k chosen experts), the experts chosen when
the token at that position was fed to the model. A position without a
record holds `NO_EXPERT` in every slot: the trainer routes it itself.
Ids are carried compactly as uint8 (models with up to 255 experts) or int16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flywheel.errors import InvalidArgument

#: A slot without a recorded expert (uint8 255 reads as -1 once widened to int16 and back: see `widen`).
NO_EXPERT = -1


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in module (layer) order; [] for a dense model."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


@dataclass(frozen=True)
class RoutingShape:
    """How many MoE layers a model has, how many experts each routes a token to, and out of how many."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        """The compact dtype of recorded ids: uint8 up to 255 experts (255 is `NO_EXPERT`), else int16."""
        return torch.uint8 if self.num_experts <= 255 else torch.int16


def routing_shape(model: nn.Module) -> RoutingShape | None:
    """None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return RoutingShape(len(found), int(found[0].top_k), int(found[0].num_experts))


def compact(ids: Tensor, shape: RoutingShape) -> Tensor:
    """Expert ids (any integer dtype, NO_EXPERT where none) in the shape's compact dtype."""
    if shape.dtype == torch.uint8:
        return torch.where(ids < 0, torch.full_like(ids, 255), ids).to(torch.uint8)
    return ids.to(torch.int16)


def widen(ids: Tensor) -> Tensor:
    """Compact ids as int64, with NO_EXPERT (-1) where none was recorded."""
    if ids.dtype == torch.uint8:
        wide = ids.to(torch.int64)
        return torch.where(wide == 255, torch.full_like(wide, NO_EXPERT), wide)
    return ids.to(torch.int64)


def routing_json(ids: Tensor) -> dict[str, Any]:
    """Compact ids as JSON (a session record's `routed_experts`): dtype, shape and the row-major bytes in base64."""
    import base64

    return {"dtype": str(ids.dtype).removeprefix("torch."), "shape": list(ids.shape),
            "data": base64.b64encode(ids.contiguous().numpy().tobytes()).decode()}


def routing_from_json(data: dict[str, Any]) -> Any:
    """`routing_json`'s inverse, as a numpy array (ValueError when it does not hold together)."""
    import base64

    import numpy as np

    if data.get("dtype") not in ("uint8", "int16"):
        raise ValueError(f"routed_experts: dtype {data.get('dtype')!r} is neither uint8 nor int16")
    flat = np.frombuffer(base64.b64decode(data["data"]), dtype=data["dtype"])
    return flat.reshape([int(n) for n in data["shape"]]).copy()


class Recorder:
    """Records, for every forward of the model while installed, the experts each router chose: after a
    forward of N tokens (one sequence, flattened as the routers see them), `take()` returns them as
    int64 [N, L, K]. Used by the transformers engine, one sequence at a time."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = routers(model)
        self._picked: list[Tensor | None] = [None] * len(self._routers)
        self._handles: list[Any] = []

    def __enter__(self) -> Recorder:
        for i, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            self._picked[layer] = output[2].detach().to("cpu", torch.int64)
        return hook

    def take(self) -> Tensor:
        picked, self._picked = self._picked, [None] * len(self._routers)
        if any(p is None for p in picked):
            raise RuntimeError("a router did not run in the last forward")
        return torch.stack(picked, dim=1)  # type: ignore[arg-type]


@dataclass
class RoutingStats:
    """Routing decisions (token, layer, expert slot) with a record, and how many of them the trainer's own
    router would have decided otherwise (a recorded expert not among its own top-k)."""

    decisions: int = 0
    flips: int = 0

    @property
    def flip_fraction(self) -> float:
        return self.flips / self.decisions if self.decisions else 0.0

    def add(self, other: RoutingStats) -> None:
        self.decisions += other.decisions
        self.flips += other.flips


def _flips(recorded: Tensor, own: Tensor, have: Tensor) -> int:
    """Recorded experts (rows `have`) that are not among the row's own top-k."""
    if not bool(have.any()):
        return 0
    rec, mine = recorded[have], own[have]
    hit = (rec[:, :, None] == mine[:, None, :]).any(-1)
    return int((~hit).sum())


@contextmanager
def replayed(model: nn.Module, routed: Tensor | None, *, replay: bool, stats: RoutingStats | None = None
             ) -> Iterator[None]:
    """Runs the model's forwards inside with `routed` ([B, T, L, K] int64, NO_EXPERT where no record; the
    forward's input_ids are [B, T]) as its routing: each router's top-k is replaced by the recorded ids
    where a row has them (`replay`), the gate weights taken from the router's own softmax at those ids.
    Either way, `stats` counts the recorded decisions its own router would have made otherwise.

    The forward must feed all B x T positions at once, in order (no shared-prefix split, no cache);
    gradient checkpointing's recompute feeds them again the same way."""
    found = routers(model)
    if routed is None or not found:
        yield
        return
    top_k = int(found[0].top_k)
    if routed.dim() != 4 or routed.shape[2] != len(found) or routed.shape[3] != top_k:
        raise InvalidArgument(f"batch.routed_experts: shape {list(routed.shape)} does not fit a model with "
                              f"{len(found)} MoE layers of top-{top_k} routing ([B, T, layers, top_k])")
    flat = routed.reshape(-1, routed.shape[2], routed.shape[3])

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, scores, own = output
            if own.shape[0] != flat.shape[0]:
                raise RuntimeError(f"routing replay: the router saw {own.shape[0]} tokens, the batch records "
                                   f"{flat.shape[0]}")
            recorded = flat[:, layer].to(own.device)
            have = (recorded >= 0).all(-1)
            if stats is not None:
                with torch.no_grad():
                    stats.add(RoutingStats(int(have.sum()) * recorded.shape[-1], _flips(recorded, own, have)))
            if not replay:
                return output
            chosen = torch.where(have[:, None], recorded, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen
        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
