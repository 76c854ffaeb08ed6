"""Sampling parameters from the wire (protobuf or OpenAI JSON) to `SamplingSpec`.

Both transports end in `make_spec`, so a value is accepted or refused the same
way whichever door it came through, and the refusal names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flywheel.common.v1 import common_pb2
from flywheel.errors import InvalidArgument
from flywheel.common.types import OutputConstraint, logprobs_mode_from_pb
from services.rollout.engine.base import SamplingSpec

MAX_N = 256
MAX_STOP_STRINGS = 16


def make_spec(
    *,
    field: str,
    max_top_logprobs: int,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    max_tokens: int | None = 16,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
    top_logprobs: int = 0,
    min_tokens: int = 0,
    repetition_penalty: float = 1.0,
    ignore_eos: bool = False,
    skip_special_tokens: bool = True,
    constraint: OutputConstraint | None = None,
    logprobs_mode: str | None = None,
    prompt_logprobs: bool = False,
) -> SamplingSpec:
    """A validated spec; `field` prefixes the names in error messages."""

    def bad(name: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"{field}{name}: {why}")

    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad("n", f"must be between 1 and {MAX_N}, got {n!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, f"must be a finite number, got {value!r}")
    if temperature < 0:
        raise bad("temperature", f"must be >= 0, got {temperature}")
    if temperature == 0 and n > 1:
        raise bad("n", f"must be 1 with greedy sampling (temperature 0), got {n}")
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    if top_k == 0:
        top_k = -1
    if not isinstance(top_k, int) or top_k < -1:
        raise bad("top_k", f"must be -1 (off) or a positive number of tokens, got {top_k!r}")
    if max_tokens is None or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise bad("max_tokens", f"must be > 0, got {max_tokens!r}")
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise bad(f"stop[{i}]", "must be a non-empty string")
    for i, t in enumerate(stop_token_ids or ()):
        if not isinstance(t, int) or t < 0:
            raise bad(f"stop_token_ids[{i}]", f"must be a token id >= 0, got {t!r}")
    if seed is not None and not isinstance(seed, int):
        raise bad("seed", f"must be an integer, got {seed!r}")
    if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= max_top_logprobs:
        raise bad("top_logprobs", f"must be between 0 and {max_top_logprobs}, got {top_logprobs!r}")
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise bad("min_tokens", f"must be >= 0, got {min_tokens!r}")
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"({min_tokens}) must not exceed max_tokens ({max_tokens})")
    if repetition_penalty <= 0:
        raise bad("repetition_penalty", f"must be > 0, got {repetition_penalty}")
    return SamplingSpec(
        n=n,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        seed=seed,
        top_logprobs=top_logprobs,
        min_tokens=min_tokens,
        repetition_penalty=float(repetition_penalty),
        ignore_eos=bool(ignore_eos),
        skip_special_tokens=bool(skip_special_tokens),
        constraint=constraint,
        logprobs_mode=logprobs_mode,
        prompt_logprobs=bool(prompt_logprobs),
    )


def from_proto(params: common_pb2.SamplingParams, *, max_top_logprobs: int, field: str = "sampling.") -> SamplingSpec:
    """Proto zeros mean "default" where common.proto says so (n, top_p, repetition_penalty)."""
    return make_spec(
        field=field,
        max_top_logprobs=max_top_logprobs,
        n=params.n or 1,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        seed=params.seed if params.HasField("seed") else None,
        top_logprobs=params.top_logprobs,
        min_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty or 1.0,
        ignore_eos=params.ignore_eos,
        logprobs_mode=_logprobs_mode(params.logprobs_mode, field),
        prompt_logprobs=params.prompt_logprobs,
    )


def _logprobs_mode(value: int, field: str) -> str | None:
    try:
        return logprobs_mode_from_pb(value)
    except ValueError:
        raise InvalidArgument(f"{field}logprobs_mode: {value} is not a LogprobsMode") from None


def from_openai(body: Any, *, max_top_logprobs: int, max_tokens: int | None, top_logprobs: int,
                constraint: OutputConstraint | None = None) -> SamplingSpec:
    """From a validated OpenAI request model (completions, chat or responses)."""
    return make_spec(
        field="",
        max_top_logprobs=max_top_logprobs,
        n=body.n if body.n is not None else 1,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=body.top_k if body.top_k is not None else -1,
        max_tokens=max_tokens,
        stop=body.stop or (),
        stop_token_ids=body.stop_token_ids or (),
        seed=body.seed,
        top_logprobs=top_logprobs,
        min_tokens=body.min_tokens or 0,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
        ignore_eos=bool(body.ignore_eos),
        skip_special_tokens=body.skip_special_tokens if body.skip_special_tokens is not None else True,
        constraint=constraint,
    )
