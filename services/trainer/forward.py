"""Per-token log-probs (and entropy) of a causal LM over right-padded sequences."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.trainer.losses import entropy_from_logits

_ENTROPY_CHUNK = 512  # positions per chunk of the no-grad entropy


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, entropy: bool = False, entropy_grad: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(token t | tokens < t) as float32 [B, T] (position 0 and padding are 0).

    With `entropy`, also the entropy of each next-token distribution, aligned
    the same way; it carries gradient only when `entropy_grad` (an entropy
    bonus), since the full-vocabulary softmax graph is costly to keep.
    With `autocast`, the model's matmuls run in that dtype (fp32 parameters
    and gradients stay as they are); the log-softmax is float32 either way.
    """
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    # Position t is predicted by the logits at t - 1; float32 for a stable log-softmax.
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    mask = attention_mask[:, 1:].to(logprobs.dtype)
    logprobs = nn.functional.pad(logprobs * mask, (1, 0))
    ent = None
    if entropy:
        if entropy_grad and torch.is_grad_enabled():
            ent = entropy_from_logits(logits)
        else:
            # A metric only: chunks along T keep the [B, T, vocab] softmax temporaries small.
            with torch.no_grad():
                ent = torch.cat([entropy_from_logits(c) for c in logits.split(_ENTROPY_CHUNK, dim=1)], dim=1)
        ent = nn.functional.pad(ent * mask, (1, 0))
    return logprobs, ent
