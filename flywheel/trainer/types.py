"""The trainer's shared words, defined once: loss kinds and how a loss is
aggregated over tokens. The trainer's config and losses, the controller's
run config and both sides of the wire read them from here; the proto enums
are named after them (`LOSS_KIND_<NAME>`, `LOSS_AGGREGATION_<NAME>`).
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


def loss_kind_to_pb(name: str | None) -> int:
    return pb.LossKind.Value(f"LOSS_KIND_{name.upper()}") if name else pb.LOSS_KIND_UNSPECIFIED


def loss_kind_from_pb(value: int) -> str | None:
    """The kind's name; None for UNSPECIFIED; ValueError for a number the proto does not define."""
    return pb.LossKind.Name(value).removeprefix("LOSS_KIND_").lower() if value else None


def aggregation_to_pb(name: str | None) -> int:
    return pb.LossAggregation.Value(f"LOSS_AGGREGATION_{name.upper()}") if name else pb.LOSS_AGGREGATION_UNSPECIFIED


def aggregation_from_pb(value: int) -> str | None:
    return pb.LossAggregation.Name(value).removeprefix("LOSS_AGGREGATION_").lower() if value else None
