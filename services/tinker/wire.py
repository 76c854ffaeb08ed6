"""The Tinker API's wire formats <-> the trainer's batches and results.

The SDK (`tinker==0.38`) sends forward_backward requests and reads
forward_backward and sample results as protobuf (`tinker.proto`, its public
schema, which ships in the SDK: the SDK owns it, we read it from there); the
rest is JSON.

A Tinker datum is a model input x[0..N) and, per position i, a target token
y[i] with its loss inputs (weights, advantages, the sampler's log-probs). The
trainer scores the next token of a sequence: position t of input_ids is
log p(ids[t] | ids[<t]). So a datum becomes the sequence x ++ [y[N-1]], and
y[i] must be x[i+1] for every i < N-1 (the shifted input every recipe
builds); a datum whose targets are not its shifted input is refused, naming
the first position where they differ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as tpb

from flywheel.errors import InvalidArgument
from flywheel.trainer.client import ForwardBackwardResult, make_loss_spec, make_train_batch
from flywheel.trainer.types import CISPO_CLIP_HIGH, CISPO_CLIP_LOW, AdamStep
from flywheel.trainer.v1 import trainer_pb2

#: Tinker's loss -> the loss_fn_inputs it reads (besides target_tokens), and those it may do without.
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}

#: Tinker's loss -> the trainer's loss kind. Tinker's ppo, -min(r A, clip(r) A) per token with r the
#: ratio p/q to the sampler's probability, is the trainer's ppo_clip under the sum reduction.
TRAINER_KIND = {"cross_entropy": "cross_entropy", "importance_sampling": "importance_sampling", "ppo": "ppo_clip",
                "cispo": "cispo"}

#: The losses that clip the ratio p/q -> the thresholds (low, high) when loss_fn_config leaves them out,
#: as tinker-cookbook 0.6.1 documents them (tutorials/202_loss_functions.py: "PPO defaults to 0.8 and
#: 1.2"; cispo `{"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}`, the trainer's own cispo default).
CLIP_THRESHOLDS: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2),
                                                   "cispo": (1.0 - CISPO_CLIP_LOW, 1.0 + CISPO_CLIP_HIGH)}
#: The loss_fn_config keys of those losses (the SDK's names): the only settings served.
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")

_NUMPY_OF = {tpb.DTYPE_FLOAT32: np.float32, tpb.DTYPE_INT64: np.int64, tpb.DTYPE_INT32: np.int32}


@dataclass
class TrainerCall:
    """What one forward_backward request asks the trainer for."""

    batch: trainer_pb2.TrainBatch
    loss: trainer_pb2.LossSpec
    #: Each datum's number of target positions (its N), in request order.
    lengths: list[int]
    forward_only: bool


def parse_forward_backward(body: bytes) -> tpb.ForwardBackwardRequest:
    """The SDK's protobuf body (zstd already undone); InvalidArgument if it does not parse."""
    request = tpb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError, or a body that is not protobuf at all
        raise InvalidArgument(f"forward_backward: the body is not a tinker ForwardBackwardRequest ({exc})") from None
    return request


def _tensor(message: tpb.Tensor, name: str) -> np.ndarray:
    if message.HasField("sparse_csr"):
        raise InvalidArgument(f"loss_fn_inputs.{name}: sparse tensors are not served; send it dense")
    kind = _NUMPY_OF.get(message.dtype)
    if kind is None:
        raise InvalidArgument(f"loss_fn_inputs.{name}: dtype {tpb.DType.Name(message.dtype)} is not served")
    data = np.frombuffer(message.dense, dtype=kind)
    shape = list(message.shape) or [data.size]
    if int(np.prod(shape)) != data.size or len(shape) != 1:
        raise InvalidArgument(f"loss_fn_inputs.{name}: a 1-D tensor per datum is expected, got shape {shape} "
                              f"with {data.size} values")
    return data


def _tokens(datum: tpb.Datum, index: int) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(f"data[{index}].model_input: {kind} chunks are not served (text models only)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if tokens.size == 0:
        raise InvalidArgument(f"data[{index}].model_input: no tokens")
    return tokens.astype(np.int64)


def _loss_config(request: tpb.ForwardBackwardRequest) -> dict[str, float]:
    """loss_fn_config's numbers by key. The SDK writes a number to both maps and text to
    loss_fn_config_v2 alone, and says servers prefer v2: a key there wins."""
    values = dict(request.loss_fn_config)
    for name, value in request.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind != "number":
            given = repr(value.text) if kind == "text" else "nothing"
            raise InvalidArgument(f"loss_fn_config.{name}: must be a number, got {given}")
        values[name] = value.number
    loss = request.loss_fn
    allowed = CLIP_KEYS if loss in CLIP_THRESHOLDS else ()
    unknown = sorted(set(values) - set(allowed))
    if unknown and not allowed:
        raise InvalidArgument(f"loss_fn_config: {loss} takes no settings here; got {', '.join(unknown)}")
    if unknown:
        raise InvalidArgument(f"loss_fn_config: {', '.join(unknown)} not served for {loss}; it takes "
                              f"{' and '.join(allowed)}")
    return values


def _clip(loss: str, config: dict[str, float]) -> dict[str, float]:
    """The trainer's clip epsilons (clip_low, clip_high) for Tinker's thresholds on the ratio p/q:
    [low, high] = [1 - clip_low, 1 + clip_high]. Nothing for a loss without a clip."""
    if loss not in CLIP_THRESHOLDS:
        return {}
    low, high = (config.get(k, default) for k, default in zip(CLIP_KEYS, CLIP_THRESHOLDS[loss], strict=True))
    if not (math.isfinite(low) and 0 <= low < 1):
        raise InvalidArgument(f"loss_fn_config.clip_low_threshold: must be in [0, 1) (0: no lower bound on the "
                              f"ratio p/q), got {low}")
    if not (math.isfinite(high) and high > 1):
        raise InvalidArgument(f"loss_fn_config.clip_high_threshold: must be a finite number > 1, got {high}")
    return {"clip_low": 1.0 - low, "clip_high": high - 1.0}


def trainer_call(request: tpb.ForwardBackwardRequest) -> TrainerCall:
    """The trainer's batch and loss for a Tinker forward_backward (or forward) request."""
    loss = request.loss_fn
    if loss not in LOSS_INPUTS:  # dro, gspo, stable_reinforce, custom: not computed here yet
        served = ", ".join(LOSS_INPUTS)
        raise InvalidArgument(f"loss_fn {loss!r} is not served by this gateway; it serves {served}")
    clip = _clip(loss, _loss_config(request))
    if not request.data:
        raise InvalidArgument("forward_backward: no data")
    needs = LOSS_INPUTS[loss]
    rows: list[dict[str, np.ndarray]] = []
    for i, datum in enumerate(request.data):
        unknown = sorted(set(datum.loss_fn_inputs) - {"target_tokens", *needs})
        if unknown:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {', '.join(unknown)} not read by {loss}")
        missing = [k for k in ("target_tokens", *needs) if k not in datum.loss_fn_inputs]
        if missing:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {loss} needs {', '.join(missing)}")
        tokens = _tokens(datum, i)
        inputs = {k: _tensor(datum.loss_fn_inputs[k], k) for k in ("target_tokens", *needs)}
        targets = inputs["target_tokens"].astype(np.int64)
        if targets.size != tokens.size:
            raise InvalidArgument(f"data[{i}]: {tokens.size} input tokens but {targets.size} target tokens")
        for k in needs:
            if inputs[k].size != tokens.size:
                raise InvalidArgument(f"data[{i}].loss_fn_inputs.{k}: {inputs[k].size} values for {tokens.size} "
                                      "positions")
        differ = np.flatnonzero(targets[:-1] != tokens[1:])
        if differ.size:
            at = int(differ[0])
            raise InvalidArgument(
                f"data[{i}]: target_tokens[{at}] = {int(targets[at])} is not model_input[{at + 1}] = "
                f"{int(tokens[at + 1])}; targets must be the input shifted by one"
            )
        rows.append({"ids": np.concatenate([tokens, targets[-1:]]), **inputs})
    width = max(r["ids"].size for r in rows)
    size = len(rows)
    input_ids = torch.zeros(size, width, dtype=torch.long)
    attention = torch.zeros(size, width, dtype=torch.long)
    mask = torch.zeros(size, width, dtype=torch.bool)
    advantages = torch.zeros(size, width, dtype=torch.float32)
    sampler = torch.zeros(size, width, dtype=torch.float32) if "logprobs" in needs else None
    for b, row in enumerate(rows):
        n = row["ids"].size
        input_ids[b, :n] = torch.from_numpy(row["ids"])
        attention[b, :n] = 1
        mask[b, 1:n] = True  # every target position: its log-prob is returned even where its weight is 0
        weights = row["weights"] if loss == "cross_entropy" else row["advantages"]
        advantages[b, 1:n] = torch.from_numpy(weights.astype(np.float32))
        if sampler is not None:
            sampler[b, 1:n] = torch.from_numpy(row["logprobs"].astype(np.float32))
    batch = make_train_batch(input_ids, attention_mask=attention, loss_mask=mask, advantages=advantages,
                             behaviour_logprobs=sampler)
    # Every Tinker loss is a sum: said, not left to the trainer's configured default.
    spec = make_loss_spec(TRAINER_KIND[loss], aggregation="sum", **clip)
    return TrainerCall(batch, spec, [r["ids"].size - 1 for r in rows], request.forward_only)


def forward_backward_output(result: ForwardBackwardResult, lengths: list[int]) -> bytes:
    """The protobuf ForwardBackwardOutput the SDK reads: each datum's target log-probs and the
    summed loss under Tinker's `name:reduction` key."""
    if result.logprobs is None:
        raise RuntimeError("the trainer sent no log-probs with its ForwardBackward result")
    per_datum = [result.logprobs[b, 1 : n + 1].to(torch.float32).numpy() for b, n in enumerate(lengths)]
    offsets = np.cumsum([0] + [a.nbytes for a in per_datum], dtype=np.int64)
    logprobs = tpb.BatchedTensor(data=b"".join(a.tobytes() for a in per_datum), offsets=offsets.tobytes(),
                                 dtype=tpb.DTYPE_FLOAT32)
    record = tpb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(lengths))
    record.fields["logprobs"].CopyFrom(logprobs)
    out = tpb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = float(result.metrics["loss"])
    return out.SerializeToString()


#: Tinker's AdamParams fields -> ours (grad_clip_norm 0 means no clipping in both).
_ADAM_FIELDS = {"learning_rate": "learning_rate", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
                "weight_decay": "weight_decay", "grad_clip_norm": "max_grad_norm"}


def adam_step(body: Mapping[str, object]) -> AdamStep:
    """The optimizer step an optim_step request's JSON asks for (Adam only)."""
    if "optimizer_params" in body or "adam_params" not in body:
        given = body.get("optimizer_params")
        kind = given.get("type") if isinstance(given, Mapping) else None
        raise InvalidArgument(f"optim_step: only Adam steps (adam_params) are served; got optimizer {kind!r}")
    params = body["adam_params"]
    if not isinstance(params, Mapping):
        raise InvalidArgument("optim_step: adam_params must be an object")
    unknown = sorted(set(params) - set(_ADAM_FIELDS))
    if unknown:
        raise InvalidArgument(f"optim_step: adam_params.{unknown[0]} is not an Adam parameter")
    values = {}
    for name, ours in _ADAM_FIELDS.items():
        if name in params:
            value = params[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"optim_step: adam_params.{name} must be a number, got {value!r}")
            values[ours] = float(value)
    return AdamStep(**values)
