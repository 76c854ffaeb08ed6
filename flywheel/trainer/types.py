"""The trainer's shared words, defined once: loss kinds, how a loss is
aggregated over tokens, and each kind's defaults for what a caller leaves
unset. The trainer's config and losses, the controller's run config and both
sides of the wire read them from here; the proto enums are named after them
(`LOSS_KIND_<NAME>`, `LOSS_AGGREGATION_<NAME>`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

from flywheel.common.types import proto_enum_names
from flywheel.errors import InvalidArgument

from flywheel.trainer.v1 import trainer_pb2 as pb

#: grpo, dapo, ppo_clip: PPO's clipped surrogate (they differ in their defaults; Tinker's ppo is
#: ppo_clip with the sum reduction). Tinker's two unclipped losses: cross_entropy, -Σ weight x
#: log-prob (the advantages are the per-token weights, any sign: supervised learning, and a client's
#: custom loss through its gradients), and importance_sampling, -Σ advantage x p/q, q the sampler's
#: probability (behaviour_logprobs). Tinker's cispo: -Σ sg(clip(p/q)) x advantage x log p, the
#: clipped ratio a constant weight on the log-prob (sg: no gradient through it), so a token outside
#: the clip range still has a gradient, of bounded size.
ClippedLossKind = Literal["grpo", "dapo", "ppo_clip"]
#: The kinds without PPO's clip or a proximal policy: no clip range, no truncated IS correction.
UnclippedLossKind = Literal["cross_entropy", "importance_sampling"]
#: Clipped, but not PPO's surrogate: a clip range, no truncated IS correction (its clip is one).
#: Not offered by the RL loop's run config, which takes ClippedLossKind.
CispoLossKind = Literal["cispo"]
LossKind = Literal[ClippedLossKind, UnclippedLossKind, CispoLossKind]
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
UNCLIPPED_KINDS: tuple[str, ...] = get_args(UnclippedLossKind)
#: The kinds whose default reduction is Tinker's sum.
SUM_KINDS: tuple[str, ...] = (*UNCLIPPED_KINDS, "cispo")

#: How per-token losses become one scalar. Sequences with no loss token count in no denominator.
#: seq_mean_token_sum_norm is Dr. GRPO's: token sums over (sequences x a constant max length).
#: sum is Tinker's: the plain sum over every loss token of the batch, nothing divided.
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

#: DAPO's "clip-higher": its upper clip epsilon when none is given (the lower one is clip_low as for any kind).
DAPO_CLIP_HIGH = 0.28
#: Tinker's cispo defaults, as epsilons: the ratio's thresholds 0 (no lower bound) and 4, one-sided
#: (tinker-cookbook 0.6.1, tutorials/202_loss_functions.py: `{"clip_low_threshold": 0.0,
#: "clip_high_threshold": 4.0}`). Its unset clip takes these, not the trainer's configured PPO clip.
CISPO_CLIP_LOW, CISPO_CLIP_HIGH = 1.0, 3.0


def default_clip_high(kind: str, clip_low: float) -> float:
    """The upper clip epsilon of `kind` when none is given: DAPO's clip-higher, cispo's Tinker
    default, else symmetric. The controller resolves a run's loss with it and the trainer a
    request's, so they agree."""
    return DAPO_CLIP_HIGH if kind == "dapo" else CISPO_CLIP_HIGH if kind == "cispo" else clip_low


def default_aggregation(kind: str) -> str:
    """The aggregation of `kind` when none is given: GRPO's per-sequence mean, Tinker's sum for its
    losses (ppo_clip excepted: the RL loop's PPO, whose Tinker callers send the sum), else DAPO's
    token mean."""
    return "seq_mean_token_mean" if kind == "grpo" else "sum" if kind in SUM_KINDS else "token_mean"


loss_kind_to_pb, loss_kind_from_pb = proto_enum_names(pb.LossKind, "LOSS_KIND_")
aggregation_to_pb, aggregation_from_pb = proto_enum_names(pb.LossAggregation, "LOSS_AGGREGATION_")


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's Adam parameters (Tinker's AdamParams): each one given replaces the
    trainer's configured value for that step only (None: the configured one, or the schedule's)."""

    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        checks = {"learning_rate": lambda v: v >= 0, "beta1": lambda v: 0 <= v < 1, "beta2": lambda v: 0 <= v < 1,
                  "eps": lambda v: v > 0, "weight_decay": lambda v: v >= 0, "max_grad_norm": lambda v: v >= 0}
        rules = {"learning_rate": ">= 0", "beta1": "in [0, 1)", "beta2": "in [0, 1)", "eps": "> 0",
                 "weight_decay": ">= 0", "max_grad_norm": ">= 0 (0: no clipping)"}
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise InvalidArgument(f"adam.{name} must be {rules[name]}, got {value}")

    def to_pb(self) -> pb.AdamStep:
        return pb.AdamStep(**{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})

    @classmethod
    def from_pb(cls, message: pb.AdamStep) -> AdamStep:
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls) if message.HasField(f.name)})


@dataclass(frozen=True)
class LoraShape:
    """One model's own LoRA adapters on a trainer that holds several (SelectModel): its rank and the modules
    with adapters (short names, e.g. "q_proj"), each within the trainer's model.lora; rank 0 and no modules:
    the trainer's own."""

    rank: int = 0
    modules: tuple[str, ...] = ()
