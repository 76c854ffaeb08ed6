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

The sampling contract (`Sampling`): log-probs are taken under the distribution
each sample was drawn from, as vLLM's sampler and ours make it: the logits
divided by the temperature, cut to the top_k most likely tokens, then to the
smallest most-likely set whose mass reaches top_p, renormalised over what is
kept. The kept set is rebuilt here from the trainer's own logits (vLLM's
sampling-mask replay needs its GPU-only model runner): on the sampling
weights the two sets are the same up to ties at the boundary, and the sampled
token is always kept, so a token the sampler drew never gets log-prob -inf
(after an update it may fall outside the new set; its probability then counts
as it would at the boundary). The set is a threshold per position (every
scaled logit >= it is kept), so backward recomputes it from one float.

Where the rollout recorded the sampler's own kept set (`kept`: TrainBatch
sampler_kept_*), that set is used instead of one rebuilt from the trainer's
logits, which for a stale sample (its weights a few versions old) is another
set: with the kept ids, exactly the sampler's support (a grammar's allowed
tokens included); with only its size (a set too big to carry), the trainer's
own most likely `size` tokens, as many as the sampler kept.

Mixture-of-experts models (`routing`): the rollout's recorded experts are
replayed in the routers (flywheel.models.moe), and the decisions the
trainer's own routers would have made otherwise are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flywheel.models.moe import RoutingStats, replayed
from services.trainer.losses import entropy_from_logits, entropy_metric

_CHUNK_ROWS = 256  # positions upcast to float32 at once (256 x 49k x 4 bytes = 50 MB)


@dataclass(frozen=True)
class Sampling:
    """Per position (one row per selected token): how its distribution was made. None: not at all."""

    temperature: Tensor | None  # float32 [N] > 0
    top_k: Tensor | None  # int64 [N], 0: none
    top_p: Tensor | None  # float32 [N], 1: none
    #: The sampler's recorded kept set: its size, int64 [N] (0: not recorded), and ids, int64 [N, M]
    #: (-1 padded; a row without any: too big to carry, the trainer's own `size` most likely kept).
    kept_size: Tensor | None = None
    kept_ids: Tensor | None = None

    @classmethod
    def of_rows(cls, temperature: Tensor | None, top_k: Tensor | None, top_p: Tensor | None,
                rows: Tensor, kept_size: Tensor | None = None, kept_ids: Tensor | None = None) -> Sampling | None:
        """Per-sample [B] settings spread to positions whose sample index is `rows` (kept sets already
        per position); None when raw."""
        if temperature is None and top_k is None and top_p is None and kept_size is None:
            return None
        pick = lambda t: None if t is None else t.to(rows.device)[rows]  # noqa: E731
        return cls(pick(temperature), pick(top_k), pick(top_p), kept_size, kept_ids)

    def chunk(self, rows: slice) -> Sampling:
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return Sampling(pick(self.temperature), pick(self.top_k), pick(self.top_p), pick(self.kept_size),
                        pick(self.kept_ids))

    @property
    def truncates(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.kept_size is not None

    def scale(self, logits: Tensor) -> Tensor:
        """float32 logits / temperature."""
        logits = logits.float()
        return logits if self.temperature is None else logits / self.temperature[:, None]

    def thresholds(self, scaled: Tensor) -> Tensor:
        """Per row, the least scaled logit the sampler keeps (-inf: everything), without gradient."""
        with torch.no_grad():
            rows, vocab = scaled.shape
            floor = torch.full((rows,), -float("inf"), device=scaled.device)
            k = None if self.top_k is None else torch.where(self.top_k > 0, self.top_k.clamp_max(vocab), vocab)
            if k is not None:
                # The k-th largest value (ties with it are kept too, as vLLM's top-k keeps them).
                top = torch.topk(scaled, int(k.max()), dim=-1).values
                floor = torch.where(k < vocab, top.gather(-1, (k - 1)[:, None]).squeeze(-1), floor)
            if self.top_p is not None:
                # Mass is that of the top-k-cut distribution; a token is kept while the mass of the tokens
                # above it is below top_p (the most likely one always is).
                ordered = torch.sort(scaled, dim=-1, descending=True).values
                ordered = ordered.masked_fill(ordered < floor[:, None], -float("inf"))
                probs = torch.softmax(ordered, dim=-1)
                above = probs.cumsum(-1) - probs
                kept = (above < self.top_p[:, None]).sum(-1).clamp_min(1)
                floor = torch.maximum(floor, ordered.gather(-1, (kept - 1)[:, None]).squeeze(-1))
            if self.kept_size is not None:
                # A recorded set overrides the rebuilt one: its ids (`cut`), or as many of the trainer's own
                # most likely tokens as the sampler kept.
                recorded = self.kept_size > 0
                size = self.kept_size.clamp(1, vocab)
                top = torch.topk(scaled, int(size.max()), dim=-1).values.gather(-1, (size - 1)[:, None]).squeeze(-1)
                by_ids = self.id_rows()
                floor = torch.where(recorded, torch.where(by_ids, -float("inf"), top), floor)
            return floor

    def id_rows(self) -> Tensor:
        """Rows whose kept set is given by its ids, bool [N]."""
        assert self.kept_size is not None
        if self.kept_ids is None:
            return torch.zeros_like(self.kept_size, dtype=torch.bool)
        return (self.kept_size > 0) & (self.kept_ids >= 0).any(-1)

    def cut(self, scaled: Tensor, floor: Tensor, targets: Tensor | None) -> Tensor:
        """`scaled` with what the sampler drops set to -inf (the target, if given, always kept)."""
        drop = scaled < floor[:, None]
        if self.kept_ids is not None:
            by_ids = self.id_rows()
            if bool(by_ids.any()):
                # Padding (-1) points at the row's first id, kept anyway (rows with ids have one first).
                ids = torch.where(self.kept_ids >= 0, self.kept_ids, self.kept_ids[:, :1].clamp_min(0))
                outside = torch.ones_like(drop).scatter_(-1, ids, False)
                drop = torch.where(by_ids[:, None], outside, drop)
        if targets is not None:
            drop.scatter_(-1, targets[:, None], False)
        return scaled.masked_fill(drop, -float("inf"))


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(logits)[i, target_i] in float32, for logits of any float dtype, under
    the sampling contract when `sampling` is given (temperature, then the kept set).

    Saves only the logits it was given (no float32 copy, no softmax) and one
    threshold per row, and recomputes the softmax chunk by chunk in backward;
    d/dlogits is grad * (onehot(target) - softmax) / temperature."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, sampling: Sampling | None) -> Tensor:  # type: ignore[override]
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        floors = []
        for start in range(0, logits.shape[0], _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            chunk, floor = _processed(logits[rows], targets[rows], sampling, rows)
            floors.append(floor)
            picked = chunk.gather(-1, targets[rows, None]).squeeze(-1)
            out[rows] = picked - torch.logsumexp(chunk, dim=-1)
        ctx.sampling = sampling
        ctx.floors = floors
        ctx.save_for_backward(logits, targets)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        sampling: Sampling | None = ctx.sampling
        grad_logits = torch.empty_like(logits)
        for i, start in enumerate(range(0, logits.shape[0], _CHUNK_ROWS)):
            rows = slice(start, start + _CHUNK_ROWS)
            chunk, _ = _processed(logits[rows], targets[rows], sampling, rows, ctx.floors[i])
            g = torch.softmax(chunk, dim=-1).mul_(-grad[rows, None])
            g.scatter_add_(-1, targets[rows, None], grad[rows, None].float())
            if sampling is not None and sampling.temperature is not None:
                g.div_(sampling.temperature[rows, None])
            grad_logits[rows] = g
        return grad_logits, None, None


class _Head(torch.autograd.Function):
    """The output head, logits = hidden @ weight.T + bias: float32 forward, backward in `dtype`.

    The logits must be float32 even under autocast: a bfloat16 head over a 49k vocabulary moves
    the log-probs by up to ~10 % and breaks the sampling contract (ratio 1 on the sampling
    weights) on 7 % of SmolLM2's tokens. Their gradient needs no more than any other layer's:
    under autocast every other matmul's backward runs in bfloat16, and so do these two, which are
    the costliest of the step on a CPU (float32 there is ~5x slower than bfloat16 with AVX-512
    BF16: the head's three float32 matmuls took a quarter of a quickstart step)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(hidden, weight)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias is None else bias.dtype
        return nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:  # type: ignore[override]
        hidden, weight = ctx.saved_tensors
        low = grad.to(ctx.dtype)
        grad_hidden = (low @ weight.to(ctx.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (low.t() @ hidden.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None


def _processed(logits: Tensor, targets: Tensor | None, sampling: Sampling | None, rows: slice,
               floor: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """A chunk's float32 logits as the sampler made them (temperature, then the kept set), and its floors."""
    if sampling is None:
        return logits.float(), None
    part = sampling.chunk(rows)
    scaled = part.scale(logits)
    if not part.truncates:
        return scaled, None
    if floor is None:
        floor = part.thresholds(scaled)
    return part.cut(scaled, floor, targets), floor


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
    sampling: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
    shared_prefix: int = 0, kept: tuple[Tensor | None, Tensor | None] = (None, None),
    routing: Tensor | None = None, replay: bool = True, routing_stats: RoutingStats | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(token t | tokens < t) as float32 [B, T] (position 0 and padding are 0).

    `sampling` is (temperature, top_k, top_p) per sample, [B] each or None (the
    batch's sampling_* fields): the distribution the log-probs are of (the
    module's docstring); all None: the raw one. Entropy is of the same.

    With `select` ([B, T], nonzero where wanted, e.g. the loss mask), only
    those positions are computed; the others are 0. With `entropy`, also the
    entropy of each next-token distribution, aligned the same way; it carries
    gradient only when `entropy_grad` (an entropy bonus). With `autocast`, the
    model's matmuls run in that dtype (fp32 parameters and gradients stay as
    they are); the log-softmax is float32 either way.

    `shared_prefix`: the first that many tokens are the same in every row (and
    every row is longer): they go through the model once, as one row, and the
    rows continue from its keys and values (`_hidden`). Exact: a causal model's
    states there do not depend on what follows, and autograd sums the rows'
    gradients through them. Ignored on the full-logits path and on a sharded
    model (FSDP's hooks expect one forward per layer and backward).

    `kept` is (sampler_kept_size [B, T], sampler_kept_ids [B, T, M] or None):
    the sampler's recorded kept set of the token at each position, used in
    place of the rebuilt one where its size is > 0. `routing` ([B, T, L, K],
    -1 where not recorded) is a mixture-of-experts model's recorded routing:
    replayed when `replay`, and counted into `routing_stats` either way; the
    positions then go through the model together (no shared prefix).
    """
    if routing is not None:
        shared_prefix = 0
    wanted = attention_mask[:, 1:] > 0
    if select is not None:
        wanted = wanted & (select[:, 1:] > 0)
    parts = _plain_head(model)
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None), \
            replayed(model, routing, replay=replay, stats=routing_stats):
        if parts is None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1][wanted]
        else:
            decoder, head = parts

            def selected_logits() -> Tensor:
                shared = 0 if _sharded(model) else shared_prefix
                hidden = _hidden(decoder, input_ids, attention_mask, shared)
                # Position t is predicted by the hidden state at t - 1.
                with torch.autocast(input_ids.device.type, enabled=False):
                    return _Head.apply(hidden[:, :-1][wanted], head.weight, head.bias, autocast or torch.float32)

            logits = _as_forward(model, selected_logits, input_ids) if _sharded(model) else selected_logits()
    targets = input_ids[:, 1:][wanted]
    kept_size, kept_ids = kept
    if kept_size is not None:
        kept_ids = None if kept_ids is None else kept_ids[:, 1:][wanted]
        kept_size = kept_size[:, 1:][wanted]
        if not bool(kept_size.any()):
            kept_size = kept_ids = None
    per_position = Sampling.of_rows(*sampling, rows=wanted.nonzero()[:, 0], kept_size=kept_size, kept_ids=kept_ids)
    picked = _TargetLogprob.apply(logits, targets, per_position)
    logprobs = nn.functional.pad(_scatter(picked, wanted), (1, 0))
    ent = None
    if entropy:
        if entropy_grad and torch.is_grad_enabled():
            values = entropy_from_logits(_differentiable_processed(logits, per_position))
        else:
            # A metric only: chunks keep the float32 softmax temporaries small.
            with torch.no_grad():
                chunks = [_processed(logits[start:start + _CHUNK_ROWS], None, per_position,
                                     slice(start, start + _CHUNK_ROWS))[0]
                          for start in range(0, len(logits), _CHUNK_ROWS)]
                values = torch.cat([entropy_metric(c) for c in chunks]) if chunks else picked.detach()
        ent = nn.functional.pad(_scatter(values, wanted), (1, 0))
    return logprobs, ent


def _hidden(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, shared_prefix: int) -> Tensor:
    """The decoder's last hidden states [B, T, H]; the first `shared_prefix` positions computed once."""
    rows = input_ids.shape[0]
    # Checkpointed layers keep no cache in training (transformers turns it off), so nothing to continue from.
    checkpointed = decoder.training and getattr(decoder, "is_gradient_checkpointing", False)
    if shared_prefix <= 0 or rows < 2 or checkpointed:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    prefix = decoder(input_ids=input_ids[:1, :shared_prefix], attention_mask=attention_mask[:1, :shared_prefix],
                     use_cache=True)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(rows)  # out of place: the rows' gradients flow back to the one prefix
    rest = decoder(input_ids=input_ids[:, shared_prefix:], attention_mask=attention_mask, past_key_values=cache,
                   use_cache=True).last_hidden_state
    return torch.cat([prefix.last_hidden_state.expand(rows, -1, -1), rest], dim=1)


def _differentiable_processed(logits: Tensor, sampling: Sampling | None) -> Tensor:
    """The whole processed logits with autograd (an entropy bonus); the cut is a constant."""
    if sampling is None:
        return logits
    scaled = sampling.scale(logits)
    if not sampling.truncates:
        return scaled
    return sampling.cut(scaled, sampling.thresholds(scaled.detach()), None)


def _scatter(values: Tensor, where: Tensor) -> Tensor:
    """values (one per True of `where`) laid out as `where`'s shape, 0 elsewhere, float32, differentiable."""
    out = torch.zeros(where.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(where, values.float())


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _as_forward(model: nn.Module, fn, anchor: Tensor):
    """fn() run as `model`'s forward: the hooks FSDP2 put on the root (gathering its own
    parameters, the embeddings and the head, and reducing their gradients) wrap it.
    `anchor` (a tensor already on the model's device) is passed and ignored: FSDP2's
    root hook in torch < 2.13 moves the call's arguments to the device and fails on a
    call with none."""
    model.forward = lambda _anchor: fn()
    try:
        return model(anchor)
    finally:
        del model.forward
