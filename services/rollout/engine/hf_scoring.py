"""Scoring given token ids with a transformers causal LM: one forward pass
over the whole sequence (a prefill, nothing sampled), the log-prob of each
next token and, when asked, the most likely tokens at each position.

The transformers engine's Score path (`TransformersEngine.score_tokens`);
log-probs are of the model's raw distribution, as prompt log-probs are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Positions turned into log-probs at a time: a whole long sequence at once would hold a
#: second float32 copy of its logits (positions x vocabulary).
_ROWS = 256


def score_sequence(model: Any, ids: Sequence[int], device: torch.device,
                   top_logprobs: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """(log p(ids[i + 1] | ids[:i + 1]) for each i, per position the `top_logprobs` most likely
    (token, log-prob), most likely first). Call under torch.inference_mode on the model's thread."""
    inputs = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logits = model(input_ids=inputs, use_cache=False).logits[0, :-1]
    targets = inputs[0, 1:]
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    for start in range(0, len(targets), _ROWS):
        rows = torch.log_softmax(logits[start:start + _ROWS].float(), dim=-1)
        chosen += rows.gather(-1, targets[start:start + _ROWS, None])[:, 0].tolist()
        if top_logprobs:
            values, tokens = torch.topk(rows, top_logprobs, dim=-1)
            top += [list(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())]
    return chosen, top
