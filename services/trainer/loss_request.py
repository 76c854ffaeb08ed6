"""What loss a trainer request asks for: the fields a caller set (`LossRequest`), and the
settings the engine trains with once the trainer's defaults fill the rest (`resolve_loss`),
each range checked and named in the error."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flywheel.errors import InvalidArgument
from flywheel.trainer.types import (
    AGGREGATIONS,
    CISPO_CLIP_LOW,
    UNCLIPPED_KINDS,
    default_aggregation,
    default_clip_high,
)
from flywheel.trainer.types import LOSS_KINDS as KINDS
from services.trainer.config import LossConfig
from services.trainer.losses import LossSettings


@dataclass(frozen=True)
class LossRequest:
    """A loss as a caller specified it: None / 0 where it left a field unset."""

    kind: str | None = None
    clip_low: float = 0.0
    clip_high: float = 0.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str | None = None
    is_cap: float = 0.0
    max_response_length: int = 0


def resolve_loss(request: LossRequest, defaults: LossConfig) -> LossSettings:
    """Fills unset fields from the config and checks ranges, naming the field."""
    for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "is_cap"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"loss.{name}: must be a finite number >= 0, got {value}")
    kind = request.kind or defaults.kind
    if kind not in KINDS:
        raise InvalidArgument(f"loss.kind: unknown {kind!r}")
    if kind in UNCLIPPED_KINDS:
        for name in ("clip_low", "clip_high", "is_cap"):  # refused, not ignored
            if getattr(request, name):
                raise InvalidArgument(f"loss.{name}: {kind} has no clip and no truncated importance weights")
    if kind == "cispo":  # the configured clip is PPO's; cispo's own is Tinker's one-sided default
        if request.is_cap:
            raise InvalidArgument("loss.is_cap: cispo takes no truncated importance weights; its clipped ratio is one")
        clip_low = request.clip_low or CISPO_CLIP_LOW
        clip_high = request.clip_high or default_clip_high(kind, clip_low)
    else:
        clip_low = request.clip_low or defaults.clip_low
        clip_high = request.clip_high or defaults.clip_high or default_clip_high(kind, clip_low)
    if clip_low > 1:  # 1: the ratio's lower bound is 0, no bound at all (Tinker's clip_low_threshold 0)
        raise InvalidArgument(f"loss.clip_low: must be <= 1 (a lower bound 1 - clip_low >= 0 on the ratio), "
                              f"got {clip_low}")
    aggregation = request.aggregation or defaults.aggregation or default_aggregation(kind)
    if aggregation not in AGGREGATIONS:
        raise InvalidArgument(f"loss.aggregation: unknown {aggregation!r}")
    max_response_length = request.max_response_length or defaults.max_response_length
    if aggregation == "seq_mean_token_sum_norm" and max_response_length < 1:
        raise InvalidArgument(
            "loss.max_response_length: seq_mean_token_sum_norm divides by the maximum completion length; "
            "set it in the request or the trainer's loss.max_response_length"
        )
    return LossSettings(
        kind=kind, clip_low=clip_low, clip_high=clip_high, kl_coef=request.kl_coef,
        entropy_coef=request.entropy_coef, aggregation=aggregation, is_cap=request.is_cap,
        kl_estimator=defaults.kl_estimator, max_response_length=max_response_length,
    )
