"""Per-token log-probs (and entropy) of a causal LM over right-padded sequences.

Where the time goes on a CPU: the output head. SmolLM2's vocabulary is 49k
tokens, so the logits of one batch are hundreds of MB, and a float32 copy,
a log-softmax and an entropy over all of them cost as much as a good part of
the transformer. So:
- the head runs only at the positions asked for (`select`: the loss mask's,
  typically the completion; the prompt's logits are never needed);
- log p(target) comes from `_TargetLogprob`, which keeps the head's output in
  its own dtype and upcasts one chunk at a time, forward and backward, instead
  of keeping a float32 copy and a softmax of the whole thing for autograd;
- the entropy metric is computed in the same chunks, without gradient.
Models whose head is more than a linear layer over the last hidden state
(final-logit soft-capping, logit scaling) take the plain full-logits path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.trainer.losses import entropy_from_logits

_CHUNK_ROWS = 256  # positions upcast to float32 at once (256 x 49k x 4 bytes = 50 MB)


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(logits)[i, target_i] in float32, for logits of any float dtype.

    Saves only the logits it was given (no float32 copy, no softmax) and
    recomputes the softmax chunk by chunk in backward; d/dlogits is
    grad * (onehot(target) - softmax)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # type: ignore[override]
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], _CHUNK_ROWS):
            chunk = logits[start : start + _CHUNK_ROWS].float()
            picked = chunk.gather(-1, targets[start : start + _CHUNK_ROWS, None]).squeeze(-1)
            out[start : start + _CHUNK_ROWS] = picked - torch.logsumexp(chunk, dim=-1)
        ctx.save_for_backward(logits, targets)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            g = torch.softmax(logits[rows].float(), dim=-1).mul_(-grad[rows, None])
            g.scatter_add_(-1, targets[rows, None], grad[rows, None].float())
            grad_logits[rows] = g
        return grad_logits, None


def _plain_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, head) when logits are exactly head(decoder(...).last_hidden_state), else None."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or decoder is model or not isinstance(head, nn.Linear):
        return None
    return decoder, head


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, select: Tensor | None = None,
    entropy: bool = False, entropy_grad: bool = False, autocast: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(token t | tokens < t) as float32 [B, T] (position 0 and padding are 0).

    With `select` ([B, T], nonzero where wanted, e.g. the loss mask), only
    those positions are computed; the others are 0. With `entropy`, also the
    entropy of each next-token distribution, aligned the same way; it carries
    gradient only when `entropy_grad` (an entropy bonus). With `autocast`, the
    model's matmuls run in that dtype (fp32 parameters and gradients stay as
    they are); the log-softmax is float32 either way.
    """
    wanted = attention_mask[:, 1:] > 0
    if select is not None:
        wanted = wanted & (select[:, 1:] > 0)
    parts = _plain_head(model)
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if parts is None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1][wanted]
        else:
            decoder, head = parts

            def selected_logits() -> Tensor:
                hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
                # Position t is predicted by the hidden state at t - 1.
                return head(hidden[:, :-1][wanted])

            logits = _as_forward(model, selected_logits) if _sharded(model) else selected_logits()
    targets = input_ids[:, 1:][wanted]
    picked = _TargetLogprob.apply(logits, targets)
    logprobs = nn.functional.pad(_scatter(picked, wanted), (1, 0))
    ent = None
    if entropy:
        if entropy_grad and torch.is_grad_enabled():
            values = entropy_from_logits(logits)
        else:
            # A metric only: chunks keep the float32 softmax temporaries small.
            with torch.no_grad():
                values = torch.cat([entropy_from_logits(c) for c in logits.split(_CHUNK_ROWS)]) if len(logits) else picked.detach()
        ent = nn.functional.pad(_scatter(values, wanted), (1, 0))
    return logprobs, ent


def _scatter(values: Tensor, where: Tensor) -> Tensor:
    """values (one per True of `where`) laid out as `where`'s shape, 0 elsewhere, float32, differentiable."""
    out = torch.zeros(where.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(where, values.float())


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _as_forward(model: nn.Module, fn):
    """fn() run as `model`'s forward: the hooks FSDP2 put on the root (gathering its own
    parameters, the embeddings and the head, and reducing their gradients) wrap it."""
    model.forward = fn
    try:
        return model()
    finally:
        del model.forward
