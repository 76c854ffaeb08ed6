"""The trainer's shared words, defined once: loss kinds, how a loss is
aggregated over tokens, and each kind's defaults for what a caller leaves
unset. The trainer's config and losses, the controller's run config and both
sides of the wire read them from here; the proto enums are named after them
(`LOSS_KIND_<NAME>`, `LOSS_AGGREGATION_<NAME>`).
"""

from __future__ import annotations

from typing import Literal, get_args

from flywheel.trainer.v1 import trainer_pb2 as pb

LossKind = Literal["grpo", "dapo", "ppo_clip"]
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)

#: How per-token losses become one scalar. Sequences with no loss token count in no denominator.
#: seq_mean_token_sum_norm is Dr. GRPO's: token sums over (sequences x a constant max length).
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

#: DAPO's "clip-higher": its upper clip epsilon when none is given (the lower one is clip_low as for any kind).
DAPO_CLIP_HIGH = 0.28


def default_clip_high(kind: str, clip_low: float) -> float:
    """The upper clip epsilon of `kind` when none is given: DAPO's clip-higher, else symmetric.
    The controller resolves a run's loss with it and the trainer a request's, so they agree."""
    return DAPO_CLIP_HIGH if kind == "dapo" else clip_low


def default_aggregation(kind: str) -> str:
    """The aggregation of `kind` when none is given: GRPO's per-sequence mean, else DAPO's token mean."""
    return "seq_mean_token_mean" if kind == "grpo" else "token_mean"


def loss_kind_to_pb(name: str | None) -> int:
    return pb.LossKind.Value(f"LOSS_KIND_{name.upper()}") if name else pb.LOSS_KIND_UNSPECIFIED


def loss_kind_from_pb(value: int) -> str | None:
    """The kind's name; None for UNSPECIFIED; ValueError for a number the proto does not define."""
    return pb.LossKind.Name(value).removeprefix("LOSS_KIND_").lower() if value else None


def aggregation_to_pb(name: str | None) -> int:
    return pb.LossAggregation.Value(f"LOSS_AGGREGATION_{name.upper()}") if name else pb.LOSS_AGGREGATION_UNSPECIFIED


def aggregation_from_pb(value: int) -> str | None:
    return pb.LossAggregation.Name(value).removeprefix("LOSS_AGGREGATION_").lower() if value else None
