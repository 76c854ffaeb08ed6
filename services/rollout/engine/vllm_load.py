"""How vLLM's worker loads a weight version into its model, and what it
measures while doing so (runs in the worker process, `vllm_transfer`).

The load is vLLM's in-place reload of checkpoint-format weights (its
layerwise reload: each layer is rebuilt from the tensors its loaders copy in,
its kernels' processing redone, the result copied into the tensors the
kernels hold), then `refresh_kept_cpu_gemms`. Around it:

- RECEIVED: every tensor is hashed (flywheel.codec.identity tensor digests)
  as the loader takes it from the stream, in this process: the bytes the
  engine consumed, whatever transport brought them;
- the loader's own accounting: vLLM counts, per layer, the elements its
  weight loaders copied into the layer's parameters; a layer left short (a
  checkpoint name the loader skipped, a shard it missed) fails the load
  instead of silently keeping old weights;
- RESIDENT: `resident_digests` reads back every parameter vLLM keeps as the
  checkpoint holds it (the token embedding and the norms on CPU; on GPU
  nearly all), fused q/k/v and gate/up cut back into the checkpoint's names.

What neither can see is the repacking of linear layers for vLLM's CPU
kernels (oneDNN or its own packed format: the weight is dropped after
packing): the update's probe covers that (flywheel.probe).

FAULT INJECTION (tests only, `LoadFaults`): the loader's output is made
wrong on purpose after the RECEIVED hash, where a loading bug would be.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from flywheel.codec.identity import identify
from flywheel.errors import DataLoss
from services.rollout.engine.base import LoadFaults, TensorSpec
from services.rollout.engine.faults import fault_targets

log = logging.getLogger(__name__)


class ReceivedDigests:
    """Hashes each tensor of a weight stream as it is handed to the loader."""

    def __init__(self) -> None:
        self.digests: dict[str, bytes] = {}

    def hashing(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.digests.update(identify({name: tensor}).tensors)
            yield name, tensor


def faulty(weights: Iterable[tuple[str, torch.Tensor]], faults: LoadFaults,
           specs: Mapping[str, TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """FAULT INJECTION: the stream as a buggy loader would pass it on (after the RECEIVED hash)."""
    targets = fault_targets(specs)
    held: dict[str, torch.Tensor] = {}
    pair = targets.swapped if faults.swap_same_shaped else None
    for i, (name, tensor) in enumerate(weights):
        if faults.raise_halfway and i == len(specs) // 2:
            log.warning("FAULT INJECTION: the load raises halfway", extra={"loaded": i})
            raise RuntimeError(f"FAULT INJECTION: the load failed after {i} of {len(specs)} tensors")
        if faults.skip_one and name == targets.skipped:
            log.warning("FAULT INJECTION: one tensor left at the previous version", extra={"tensor": name})
            continue
        if faults.scale_linear and name == targets.linear:
            log.warning("FAULT INJECTION: a linear layer's weight scaled", extra={"tensor": name,
                                                                                   "factor": faults.scale_linear})
            tensor = tensor * faults.scale_linear
        if pair is not None and name in pair:
            held[name] = tensor
            if len(held) < 2:
                continue
            log.warning("FAULT INJECTION: two same-shaped tensors swapped by the loader", extra={"tensors": pair})
            yield pair[0], held[pair[1]]
            yield pair[1], held[pair[0]]
            continue
        yield name, tensor


def corrupt_readable(model: torch.nn.Module, specs: Mapping[str, TensorSpec]) -> str:
    """FAULT INJECTION: one element of a tensor vLLM keeps readable, changed after the load."""
    name = fault_targets(specs).readable
    param = dict(model.named_parameters())[name]
    with torch.no_grad():
        param.data.view(-1)[param.numel() // 2] += 1
    log.warning("FAULT INJECTION: one element of a loaded tensor changed", extra={"tensor": name})
    return name


def load_in_place(vllm_config: Any, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's layerwise in-place reload of checkpoint-format weights, checked against the loader's
    own count of what it copied, then the CPU GEMM refresh. On any failure the reload is still
    finalized (vLLM puts back the kernel tensors of the layers that loaded nothing) so that the
    next update can load: what the model holds then is no version, and the update says so."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload, initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(weights)
        short = _layers_left_short(model)
    finally:
        finalize_layerwise_reload(model, vllm_config.model_config)
        refresh_kept_cpu_gemms(model)
    if short:
        shown = ", ".join(short[:3]) + (f" and {len(short) - 3} more" if len(short) > 3 else "")
        raise DataLoss(f"the loader left {len(short)} layer(s) short of their weights ({shown}): "
                       "a checkpoint tensor was not loaded")


def _layers_left_short(model: torch.nn.Module) -> list[str]:
    """Layers whose weight loaders copied in some of their elements but not all (vLLM's own count):
    a fused layer that got one of its shards (q without k and v, gate without up), the mark of a
    loader that dropped a checkpoint tensor. A layer that got all of them was processed and reset as
    it completed. Not counted: layers that got none (vLLM keeps their tensors: a tied output head,
    rotary caches, which no checkpoint holds), attention layers (processed at the end by design) and
    vocabulary embeddings (padded past the checkpoint's rows)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    short = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or is_deferred_attention_layer(layer):
            continue
        kind = type(layer).__name__
        if "Embedding" in kind or "LMHead" in kind:
            continue
        total = info.load_numel_total or 0
        if 0 < info.load_numel < total:
            short.append(f"{name} ({info.load_numel} of {total} elements)")
    return short


def resident_digests(model: torch.nn.Module, specs: Mapping[str, TensorSpec]) -> dict[str, bytes]:
    """Identity digests of the weights resident in the model, under the checkpoint's names: every
    parameter held as the checkpoint holds it (same dtype and shape), and the parts of a fused one
    (vLLM stacks q/k/v and gate/up) cut back along their first dimension. Layers vLLM repacked for
    its CPU kernels and dropped the weight of cannot be read back."""
    readable: dict[str, torch.Tensor] = {}
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            continue
        if name in specs:
            readable[name] = param
            continue
        for fused, parts in packed.items():
            if f".{fused}." not in name:
                continue
            pieces = [name.replace(f".{fused}.", f".{part}.") for part in parts]
            if all(p in specs for p in pieces) and sum(specs[p].shape[0] for p in pieces) == param.shape[0]:
                for piece, chunk in zip(pieces, param.split([specs[p].shape[0] for p in pieces])):
                    readable[piece] = chunk
    held = {n: t for n, t in readable.items() if t.dtype == specs[n].dtype and tuple(t.shape) == tuple(specs[n].shape)}
    return dict(identify(held).tensors)


def refresh_kept_cpu_gemms(model: torch.nn.Module) -> int:
    """Re-ties a tied LM head to the (reloaded) embedding and repacks the CPU GEMM copy of every
    layer that keeps its weight; a no-op off CPU. Returns how many layers were repacked.

    On CPU, vLLM packs a copy of every GEMM weight at load for its kernels, and
    layers that keep their weight besides (the token embedding, and an LM head
    tied to it) are not repacked by a reload. A model with tied embeddings
    (SmolLM2, the tiny test models) then served new weights everywhere but in
    its output head: samples came from a model nobody trained."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    config = getattr(model, "config", None)
    head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
    embedding = getattr(body, "embed_tokens", None)
    if getattr(config, "tie_word_embeddings", False) and head is not None and embedding is not None:
        head.weight = embedding.weight
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # Layers whose weight was removed after packing (linear layers) were repacked by the reload.
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
