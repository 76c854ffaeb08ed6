"""The Score call's input, checked before anything runs: given token ids
(one or more sequences) whose log-probs the served weights compute, and how
many most likely tokens to return per position. Bad ids or shapes are
INVALID_ARGUMENT; more work than `limits` allows is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.errors import InvalidArgument, ResourceExhausted
from services.rollout.config import LimitsConfig
from services.rollout.serving.prompts import check_token_ids


def check_score_request(sequences: Sequence[Sequence[int]], top_logprobs: int, limits: LimitsConfig, *,
                        vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The sequences as lists, or the error that names the first bad field."""
    if not sequences:
        raise InvalidArgument("sequences: at least one sequence is needed")
    if len(sequences) > limits.max_score_sequences:
        raise ResourceExhausted(f"sequences: {len(sequences)} sequences; one call scores at most "
                                f"{limits.max_score_sequences} (limits.max_score_sequences)")
    if not 0 <= top_logprobs <= limits.max_top_logprobs:
        raise InvalidArgument(f"top_logprobs: must be between 0 and {limits.max_top_logprobs}, got {top_logprobs}")
    checked, total = [], 0
    for i, seq in enumerate(sequences):
        ids = list(seq)
        if len(ids) < 2:
            raise InvalidArgument(f"sequences[{i}].ids: {len(ids)} token(s); a sequence needs at least 2 (the first "
                                  "token has no log-prob)")
        if len(ids) > max_model_len:
            raise InvalidArgument(f"sequences[{i}].ids: {len(ids)} tokens; the model's context holds {max_model_len}")
        check_token_ids(ids, vocab_size, f"sequences[{i}].ids")
        total += len(ids)
        checked.append(ids)
    if total > limits.max_score_tokens:
        raise ResourceExhausted(f"sequences: {total} tokens in all; one call scores at most {limits.max_score_tokens} "
                                "(limits.max_score_tokens)")
    return checked
