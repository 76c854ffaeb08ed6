"""Training batches: the validated domain form of a TrainBatch.

`training_batch(...)` / `input_batch(...)` take the decoded tensors of a
request (any may be missing) and either return a `Batch` whose tensors have
the dtypes and shapes the training code relies on, or raise InvalidArgument /
FailedPrecondition naming the offending field. Validation happens before any
state is touched, so a rejected request leaves the model and optimizer as
they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from flywheel.errors import FailedPrecondition, InvalidArgument

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Log-probs are <= 0; engines round, so allow a little above.
_LOGPROB_TOLERANCE = 1e-3


#: Shorter shared prompts are computed per row: a separate pass for a few tokens saves less than it costs.
MIN_SHARED_PREFIX = 8


@dataclass(frozen=True)
class MicroBatch:
    """Rows [start, stop) of a planned batch, trained together; their first `shared_prefix`
    tokens are the same in every row (0: nothing shared)."""

    start: int
    stop: int
    shared_prefix: int = 0


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_sequence_length: int
    vocab_size: int


@dataclass
class Batch:
    """Tensors of one batch, all on the same device; [B, T] unless noted."""

    input_ids: Tensor  # int64
    attention_mask: Tensor  # int64, 1 for real tokens, right-padded
    loss_mask: Tensor | None = None  # float32
    advantages: Tensor | None = None  # float32, per token
    behaviour_logprobs: Tensor | None = None  # float32, 0 outside the loss mask
    weight_versions: Tensor | None = None  # int64 [B] per sample, or [B, T] per token (read where loss_mask > 0)
    old_logprobs: Tensor | None = None  # float32
    ref_logprobs: Tensor | None = None  # float32
    #: The distribution each sample was drawn from (the sampling contract), [B] each; None: raw
    #: (temperature 1), no top-k (0), no top-p (1).
    sampling_temperature: Tensor | None = None  # float32 > 0
    sampling_top_k: Tensor | None = None  # int64 >= 0
    sampling_top_p: Tensor | None = None  # float32 in (0, 1]
    #: The sampler's own kept set per position (TrainBatch sampler_kept_*): its size, 0 where not
    #: recorded, int64 [B, T]; its ids, int64 [B, T, M], -1 padded (none given: too big to carry).
    sampler_kept_size: Tensor | None = None
    sampler_kept_ids: Tensor | None = None
    #: The rollout's routing, int64 [B, T, L, K], NO_EXPERT (-1) where not recorded (flywheel.models.moe).
    routed_experts: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def rows(self, start: int, stop: int) -> Batch:
        """The samples [start, stop) (views, no copies)."""
        return Batch(**{f.name: _rows(getattr(self, f.name), start, stop) for f in fields(self)})

    def take(self, order: Tensor) -> Batch:
        """The rows `order` names, in that order (copies)."""
        return Batch(**{f.name: _take(getattr(self, f.name), order) for f in fields(self)})

    def prompts(self) -> Tensor:
        """Per row, how many leading tokens come before its first loss position: the prompt, which
        the rows of one group share (0 without a loss mask, or for a row with nothing to learn)."""
        if self.loss_mask is None:
            return torch.zeros(self.size, dtype=torch.int64)
        learned = (self.loss_mask > 0) & (self.attention_mask > 0)
        first = learned.int().argmax(-1)
        return torch.where(learned.any(-1), first, 0).cpu()

    def planned(self, micro: int) -> tuple[Batch, Tensor, list[MicroBatch]]:
        """The same rows reordered into micro-batches of at most `micro` rows, each new row's index
        in this batch, and the micro-batches (contiguous in the new order).

        Rows that share a prompt (a GRPO group: the same question, sampled n times) go together,
        and their micro-batch names the shared length: the model computes those positions once
        for all of them (`forward.token_logprobs`), the gradient summing what each row sends
        back through them, so the step is the one the rows give apart. With the quickstart's 40
        prompt tokens and 8 samples a question, that is about a third of a step's tokens. Rows
        alone with their prompt come after, longest first, so that consecutive rows have similar
        lengths and `trimmed` drops most of their padding."""
        prompts = self.prompts()
        groups: dict[bytes, list[int]] = {}
        for row in range(self.size):
            shared = int(prompts[row])
            key = self.input_ids[row, :shared].cpu().numpy().tobytes() if shared >= MIN_SHARED_PREFIX else b""
            groups.setdefault(key, []).append(row)
        lengths = self.attention_mask.sum(-1).cpu()
        by_length = lambda rows: sorted(rows, key=lambda r: -int(lengths[r]))  # noqa: E731 (stable: ties in order)
        alone = groups.pop(b"", [])
        order: list[int] = []
        plans: list[MicroBatch] = []
        for rows in groups.values():
            if len(rows) == 1:
                alone.extend(rows)
                continue
            shared = int(prompts[rows[0]])
            rows = by_length(rows)
            for start in range(0, len(rows), micro):
                part = rows[start:start + micro]
                plans.append(MicroBatch(len(order), len(order) + len(part), shared if len(part) > 1 else 0))
                order.extend(part)
        alone = by_length(sorted(alone))
        for start in range(0, len(alone), micro):
            part = alone[start:start + micro]
            plans.append(MicroBatch(len(order), len(order) + len(part)))
            order.extend(part)
        index = torch.tensor(order, dtype=torch.int64)
        return self.take(index.to(self.input_ids.device)), index, plans

    def trimmed(self) -> Batch:
        """Without the padding columns no row reaches (right padding: every real token stays, and a
        causal model computes the same for it)."""
        width = int(self.attention_mask.sum(-1).max())
        if width == self.seq_len:
            return self
        return Batch(**{f.name: _columns(getattr(self, f.name), width, self.seq_len) for f in fields(self)})

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    def with_(self, **changes: Tensor | None) -> Batch:
        return replace(self, **changes)


def _rows(t: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if t is None else t[start:stop]


def _take(t: Tensor | None, order: Tensor) -> Tensor | None:
    return None if t is None else t[order]


def _columns(t: Tensor | None, width: int, seq_len: int) -> Tensor | None:
    """The first `width` positions of a [B, T, ...] tensor; [B] tensors as they are."""
    return t[:, :width] if t is not None and t.dim() >= 2 and t.shape[1] == seq_len else t


def _to(t: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)


def _where(bad: Tensor) -> str:
    """Count and first index of the True entries of `bad`, for messages."""
    idx = [int(i) for i in bad.nonzero()[0]]
    return f"{int(bad.sum())} value(s), first at {idx}"


def _check_dtype(name: str, t: Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        raise InvalidArgument(f"batch.{name}: dtype {str(t.dtype).removeprefix('torch.')} is not {what}")


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...], ref: str) -> None:
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"batch.{name}: shape {list(t.shape)} does not match {ref} {list(shape)}")


def input_batch(tensors: Mapping[str, Tensor | None], limits: BatchLimits) -> Batch:
    """Validates input_ids and attention_mask, the sampling_* fields and routed_experts (all ComputeLogprobs
    reads)."""
    ids = tensors.get("input_ids")
    if ids is None:
        raise InvalidArgument("batch.input_ids: missing")
    _check_dtype("input_ids", ids, _INTS, "an integer type")
    if ids.dim() != 2:
        raise InvalidArgument(f"batch.input_ids: must be 2-D [B, T], got shape {list(ids.shape)}")
    b, t = ids.shape
    if b == 0:
        raise InvalidArgument("batch.input_ids: the batch is empty (B = 0)")
    if t < 2:
        raise InvalidArgument(f"batch.input_ids: sequences need at least 2 tokens, got T = {t}")
    if t > limits.max_sequence_length:
        raise InvalidArgument(f"batch.input_ids: T = {t} exceeds limits.max_sequence_length = {limits.max_sequence_length}")
    if b * t > limits.max_batch_tokens:
        raise InvalidArgument(
            f"batch.input_ids: {b}x{t} = {b * t} tokens exceeds limits.max_batch_tokens = {limits.max_batch_tokens}; "
            "split the batch"
        )
    ids = ids.to(torch.int64)
    out_of_vocab = (ids < 0) | (ids >= limits.vocab_size)
    if out_of_vocab.any():
        raise InvalidArgument(f"batch.input_ids: ids outside [0, {limits.vocab_size}): {_where(out_of_vocab)}")

    mask = tensors.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    else:
        _check_dtype("attention_mask", mask, (torch.bool, *_INTS), "bool or an integer type")
        _check_shape("attention_mask", mask, (b, t), "input_ids")
        mask = mask.to(torch.int64)
        if ((mask != 0) & (mask != 1)).any():
            raise InvalidArgument("batch.attention_mask: values must be 0 or 1")
        # Right padding: once a row hits padding it stays padding (positions are 0..n-1).
        if (mask[:, 1:] > mask[:, :-1]).any():
            rows = (mask[:, 1:] > mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
            raise InvalidArgument(f"batch.attention_mask: must be right-padded (1s then 0s); rows {rows[:8]} are not")
        if (mask[:, 0] == 0).any():
            raise InvalidArgument("batch.attention_mask: a sample has no real tokens")
    return Batch(input_ids=ids, attention_mask=mask, routed_experts=_routed_experts(tensors, (b, t)),
                 **_sampling(tensors, b))


def _sampling(tensors: Mapping[str, Tensor | None], b: int) -> dict[str, Tensor | None]:
    """The sampling_* fields, checked; a field that changes nothing (temperature 1, no cut-off) is None."""
    temperature, top_k, top_p = (tensors.get(f"sampling_{n}") for n in ("temperature", "top_k", "top_p"))
    if temperature is not None:
        _check_dtype("sampling_temperature", temperature, _FLOATS, "a floating-point type")
        _check_shape("sampling_temperature", temperature, (b,), "the batch size")
        temperature = temperature.to(torch.float32)
        bad = ~torch.isfinite(temperature) | (temperature <= 0)
        if bad.any():
            raise InvalidArgument(f"batch.sampling_temperature: must be finite and > 0 (greedy samples have no "
                                  f"sampling distribution; send 1, their log-probs are raw): {_where(bad)}")
        if bool((temperature == 1).all()):
            temperature = None
    if top_k is not None:
        _check_dtype("sampling_top_k", top_k, _INTS, "an integer type")
        _check_shape("sampling_top_k", top_k, (b,), "the batch size")
        top_k = top_k.to(torch.int64)
        if (top_k < 0).any():
            raise InvalidArgument(f"batch.sampling_top_k: must be >= 0 (0: no cut-off): {_where(top_k < 0)}")
        if not bool(top_k.any()):
            top_k = None
    if top_p is not None:
        _check_dtype("sampling_top_p", top_p, _FLOATS, "a floating-point type")
        _check_shape("sampling_top_p", top_p, (b,), "the batch size")
        top_p = top_p.to(torch.float32)
        bad = ~torch.isfinite(top_p) | (top_p <= 0) | (top_p > 1)
        if bad.any():
            raise InvalidArgument(f"batch.sampling_top_p: must be in (0, 1] (1: no cut-off): {_where(bad)}")
        if bool((top_p == 1).all()):
            top_p = None
    return {"sampling_temperature": temperature, "sampling_top_k": top_k, "sampling_top_p": top_p}


def _float_field(
    tensors: Mapping[str, Tensor | None], name: str, shape: tuple[int, ...], loss_mask: Tensor, *, logprob: bool
) -> Tensor | None:
    t = tensors.get(name)
    if t is None:
        return None
    _check_dtype(name, t, _FLOATS, "a floating-point type")
    _check_shape(name, t, shape, "input_ids")
    t = t.to(torch.float32)
    selected = loss_mask > 0
    bad = ~torch.isfinite(t) & selected
    if bad.any():
        raise InvalidArgument(f"batch.{name}: NaN or inf under the loss mask: {_where(bad)}")
    if logprob and ((t > _LOGPROB_TOLERANCE) & selected).any():
        raise InvalidArgument(f"batch.{name}: log-probs must be <= 0: {_where((t > _LOGPROB_TOLERANCE) & selected)}")
    # Values outside the mask are ignored; zero them so 0 * NaN cannot leak in.
    return torch.where(selected, t, torch.zeros_like(t))


def training_batch(
    tensors: Mapping[str, Tensor | None], limits: BatchLimits, *, weight_version: int, needs_behaviour: bool
) -> Batch:
    """Validates every field a ForwardBackward/TrainStep reads.

    `needs_behaviour` says whether the loss reads behaviour_logprobs (always,
    unless old_logprobs are given and the IS correction is off). Samples from
    a weight version newer than the trainer's are a FAILED_PRECONDITION: the
    caller's view of the run is out of date (e.g. the trainer was restored
    from an older checkpoint).
    """
    batch = input_batch(tensors, limits)
    shape = (batch.size, batch.seq_len)

    loss_mask = tensors.get("loss_mask")
    if loss_mask is None:
        raise InvalidArgument("batch.loss_mask: missing")
    _check_dtype("loss_mask", loss_mask, (torch.bool, *_INTS, *_FLOATS), "bool, integer or float")
    _check_shape("loss_mask", loss_mask, shape, "input_ids")
    loss_mask = loss_mask.to(torch.float32)
    if not torch.isfinite(loss_mask).all() or (loss_mask < 0).any() or (loss_mask > 1).any():
        raise InvalidArgument("batch.loss_mask: values must lie in [0, 1]")
    on_padding = (loss_mask > 0) & (batch.attention_mask == 0)
    if on_padding.any():
        raise InvalidArgument(f"batch.loss_mask: selects padding (attention_mask 0): {_where(on_padding)}")
    if (loss_mask[:, 0] > 0).any():
        raise InvalidArgument("batch.loss_mask: position 0 has no log-prob (nothing precedes it) and must be 0")
    if float(loss_mask.sum()) == 0:
        raise InvalidArgument("batch.loss_mask: selects no tokens")

    adv = tensors.get("advantages")
    if adv is None:
        raise InvalidArgument("batch.advantages: missing")
    _check_dtype("advantages", adv, _FLOATS, "a floating-point type")
    if tuple(adv.shape) == (batch.size,):
        adv = adv[:, None].expand(shape)
    elif tuple(adv.shape) != shape:
        raise InvalidArgument(f"batch.advantages: shape {list(adv.shape)} is neither [B] = [{batch.size}] nor [B, T] = {list(shape)}")
    adv = adv.to(torch.float32)
    if not torch.isfinite(adv).all():
        raise InvalidArgument(f"batch.advantages: NaN or inf: {_where(~torch.isfinite(adv))}")

    behaviour = _float_field(tensors, "behaviour_logprobs", shape, loss_mask, logprob=True)
    old = _float_field(tensors, "old_logprobs", shape, loss_mask, logprob=True)
    ref = _float_field(tensors, "ref_logprobs", shape, loss_mask, logprob=True)
    if needs_behaviour and behaviour is None:
        raise InvalidArgument("batch.behaviour_logprobs: missing (the loss reads them: importance_sampling, is_cap > 0, "
                              "or no old_logprobs sent)")

    versions = tensors.get("weight_versions")
    if versions is not None:
        _check_dtype("weight_versions", versions, _INTS, "an integer type")
        if tuple(versions.shape) not in ((batch.size,), shape):
            raise InvalidArgument(f"batch.weight_versions: shape {list(versions.shape)} is neither [B] = "
                                  f"[{batch.size}] (per sample) nor [B, T] = {list(shape)} (per token)")
        versions = versions.to(torch.int64)
        read = versions if versions.dim() == 1 else versions[loss_mask > 0]
        if (read < 0).any():
            raise InvalidArgument("batch.weight_versions: must be >= 0")
        if (read > weight_version).any():
            raise FailedPrecondition(
                f"batch.weight_versions: tokens from version {int(read.max())} but the trainer is at "
                f"weight version {weight_version}"
            )
    return batch.with_(
        **_sampler_kept(tensors, batch, loss_mask, limits),
        loss_mask=loss_mask,
        advantages=adv.contiguous(),
        behaviour_logprobs=behaviour,
        old_logprobs=old,
        ref_logprobs=ref,
        weight_versions=versions,
    )


def _sampler_kept(tensors: Mapping[str, Tensor | None], batch: Batch, loss_mask: Tensor, limits: BatchLimits
                  ) -> dict[str, Tensor | None]:
    """sampler_kept_size / sampler_kept_ids, checked where the loss reads them: a kept set holds the token
    drawn from it, and its ids number its size."""
    size, ids = tensors.get("sampler_kept_size"), tensors.get("sampler_kept_ids")
    if size is None:
        if ids is not None:
            raise InvalidArgument("batch.sampler_kept_ids: given without sampler_kept_size")
        return {}
    shape = (batch.size, batch.seq_len)
    _check_dtype("sampler_kept_size", size, _INTS, "an integer type")
    _check_shape("sampler_kept_size", size, shape, "input_ids")
    read = loss_mask > 0
    size = torch.where(read, size.to(torch.int64), 0)
    if (size < 0).any() or (size > limits.vocab_size).any():
        raise InvalidArgument(f"batch.sampler_kept_size: must lie in [0, {limits.vocab_size}]")
    if ids is not None:
        _check_dtype("sampler_kept_ids", ids, _INTS, "an integer type")
        if ids.dim() != 3 or tuple(ids.shape[:2]) != shape:
            raise InvalidArgument(f"batch.sampler_kept_ids: shape {list(ids.shape)} is not [B, T, M] with [B, T] = "
                                  f"{list(shape)}")
        ids = ids.to(torch.int64)
        given = (ids >= 0) & read[..., None]
        if (ids >= limits.vocab_size).any():
            raise InvalidArgument(f"batch.sampler_kept_ids: ids outside [-1, {limits.vocab_size})")
        count = given.sum(-1)
        bad = (count > 0) & (count != size)
        if bad.any():
            raise InvalidArgument(f"batch.sampler_kept_ids: a position's ids do not number its sampler_kept_size: "
                                  f"{_where(bad)}")
        has_token = (ids == batch.input_ids[..., None]).any(-1)
        bad = (count > 0) & ~has_token
        if bad.any():
            raise InvalidArgument(f"batch.sampler_kept_ids: the token at a position is not in its kept set: "
                                  f"{_where(bad)}")
        ids = torch.where(given, ids, -1)
        if not bool(given.any()):
            ids = None
    if not bool(size.any()):
        return {}
    return {"sampler_kept_size": size, "sampler_kept_ids": ids}


def _routed_experts(tensors: Mapping[str, Tensor | None], shape: tuple[int, int]) -> Tensor | None:
    from flywheel.models.moe import widen

    routed = tensors.get("routed_experts")
    if routed is None:
        return None
    _check_dtype("routed_experts", routed, _INTS, "an integer type")
    if routed.dim() != 4 or tuple(routed.shape[:2]) != shape:
        raise InvalidArgument(f"batch.routed_experts: shape {list(routed.shape)} is not [B, T, L, K] with [B, T] = "
                              f"{list(shape)}")
    return widen(routed)
