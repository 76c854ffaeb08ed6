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

Two ways to load (`updates.prepare_outside_pause`):
- in place (`load_in_place`): vLLM's reload into the live model, all of it
  inside generation's pause (on CPU the repacking of every linear layer is
  most of the pause);
- prepared (`prepare_twin`, then `commit`): the version is loaded, and
  repacked, into a twin of the model's modules while generation goes on
  (each module a shallow copy with tensors of its own, built from vLLM's
  own reload metadata and loaders), and the pause only moves each module's
  tensors and kernel handles over (`commit`: pointer swaps). It costs one
  more copy of the weights in memory while an update is prepared.

FAULT INJECTION (tests only, `LoadFaults`): the loader's output is made
wrong on purpose after the RECEIVED hash, where a loading bug would be.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
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


@dataclass
class PreparedLoad:
    """A version loaded and processed into a twin of the model, ready to be committed."""

    #: (live module, its twin), for every module the version was loaded into.
    pairs: list[tuple[torch.nn.Module, torch.nn.Module]]
    #: RECEIVED digests of the load (checkpoint names).
    received: dict[str, bytes] = field(default_factory=dict)


#: A module's own machinery, never moved by a commit (the twin has copies of its own).
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _twin(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, torch.nn.Module]]:
    """id(live module) -> (live, twin) for every module: shallow copies with dicts of their own
    (a module shared by two parents, like a tied output head, stays one twin)."""
    pairs: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        found = pairs.get(id(module))
        if found is not None:
            return found[1]
        twin = copy.copy(module)
        pairs[id(module)] = (module, twin)
        twin._parameters = dict(module._parameters)
        twin._buffers = dict(module._buffers)
        twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        twin._modules = {name: clone(child) if child is not None else None for name, child in module._modules.items()}
        return twin

    clone(model)
    return pairs


def _rebound(tensor: torch.Tensor, live: torch.nn.Module, twin: torch.nn.Module) -> torch.Tensor:
    """A copy of `tensor` (a meta tensor, or a parameter vLLM never puts on meta) whose loader methods
    are bound to `twin` where they were bound to `live` or to vLLM's placeholder."""
    from types import MethodType

    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    if tensor.is_meta:
        made = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    else:
        made = torch.nn.Parameter(tensor.data.clone(), requires_grad=False) if isinstance(
            tensor, torch.nn.Parameter) else tensor.data.clone()
    made.__class__ = tensor.__class__
    made.__dict__ = tensor.__dict__.copy()
    for key, value in made.__dict__.items():
        # An in-place reload leaves its buffering wrapper on the metadata it restored (bound to the live
        # layer's reload state): the twin's loads would be buffered into the live layer. The loader under it.
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, MethodType) and value.__self__ in (live, layer_ref_sentinel):
            value = value.__func__.__get__(twin)
        made.__dict__[key] = value
    return made


def prepare_twin(vllm_config: Any, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 specs: Mapping[str, TensorSpec], faults: LoadFaults) -> PreparedLoad:
    """Loads a version into a twin of `model` (see the module docstring), with vLLM's own loaders and
    processing (repacking) layer by layer, while the live model serves on. Checked as `load_in_place`
    checks; on failure the twin is dropped and the live model is untouched."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    pairs = _twin(model)
    try:
        return _load_twin(vllm_config, model, pairs, weights, specs, faults)
    finally:
        # vLLM keeps each layer's reload state in a WeakKeyDictionary, but a twin's state holds tensors whose
        # loader methods are bound to the twin: the value keeps its key, and with it the twin (and the version
        # it was loaded with). A twin's state is not needed past its load. (This alone did not stop the
        # quickstart's worker from growing with the twin on: docs/verification.md.)
        for _, twin in pairs.values():
            LAYERWISE_INFO.pop(twin, None)


def _load_twin(vllm_config: Any, model: torch.nn.Module, pairs: dict[int, tuple[torch.nn.Module, torch.nn.Module]],
               weights: Iterable[tuple[str, torch.Tensor]], specs: Mapping[str, TensorSpec],
               faults: LoadFaults) -> PreparedLoad:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO, _layerwise_process, get_layerwise_info, initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, restore_layer_on_meta

    twin_model = pairs[id(model)][1]
    ready: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    for live, twin in pairs.values():
        info = LAYERWISE_INFO.get(live)
        params, buffers = info.restore_metadata if info is not None else ({}, {})
        if info is None or is_deferred_attention_layer(live) or not (params or buffers):
            # Nothing of a checkpoint is loaded into it on this path (an attention layer holds no weights
            # unquantized); should a loader write into one of its parameters all the same, it writes a copy.
            twin._parameters = {n: _rebound(t, live, twin) if t is not None else None
                                for n, t in twin._parameters.items()}
            continue
        mine = get_layerwise_info(twin)
        mine.restore_metadata = ({n: _rebound(t, live, twin) for n, t in params.items()},
                                 {n: _rebound(t, live, twin) for n, t in buffers.items()})
        mine.restore_device = info.restore_device
        mine.kernel_tensors = None  # the twin keeps what it processes: nothing is copied into live tensors
        # Tensors vLLM never puts on meta (a bias) get copies of their own: a load into the live one would
        # change the served model before the pause.
        for name in SKIP_TENSORS:
            if twin._parameters.get(name) is not None:
                twin._parameters[name] = _rebound(twin._parameters[name], live, twin)
        restore_layer_on_meta(twin, mine)
        initialize_online_processing(twin)
        ready.append((live, twin))
    received = ReceivedDigests()
    stream: Iterator[tuple[str, torch.Tensor]] = received.hashing(weights)
    wrong = replace(faults, raise_halfway=False)  # that one fails the commit, inside the pause
    if wrong.any:
        stream = faulty(stream, wrong, specs)
    twin_model.load_weights(stream)
    loaded: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    short: list[str] = []
    names = {id(m): n for n, m in twin_model.named_modules()}
    for live, twin in ready:
        info = LAYERWISE_INFO[twin]
        if not info.can_load():
            loaded.append((live, twin))  # loaded whole, and processed as it completed
        elif info.load_numel > 0:
            kind = type(twin).__name__
            if "Embedding" not in kind and "LMHead" not in kind:
                short.append(f"{names.get(id(twin), kind)} ({info.load_numel} of {info.load_numel_total} elements)")
            _layerwise_process(twin, info)  # padded past the checkpoint (a vocabulary): processed as vLLM does
            loaded.append((live, twin))
        # else: no checkpoint tensor for it (rotary caches, a tied head): the live one stays
    if short:
        shown = ", ".join(short[:3]) + (f" and {len(short) - 3} more" if len(short) > 3 else "")
        raise DataLoss(f"the loader left {len(short)} layer(s) short of their weights ({shown}): "
                       "a checkpoint tensor was not loaded")
    loaded += _retie_head(twin_model, pairs)
    return PreparedLoad(loaded, received.digests)


def _retie_head(twin_model: torch.nn.Module,
                pairs: dict[int, tuple[torch.nn.Module, torch.nn.Module]]) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """An output head tied to the token embedding loads nothing of its own: the twin's is tied to the
    twin's embedding and its CPU GEMM packed from it (`refresh_kept_cpu_gemms`, on the twin)."""
    from vllm.platforms import current_platform

    config = getattr(twin_model, "config", None)
    head, body = getattr(twin_model, "lm_head", None), getattr(twin_model, "model", None)
    embedding = getattr(body, "embed_tokens", None)
    if not (getattr(config, "tie_word_embeddings", False) and head is not None and embedding is not None) \
            or head is embedding:
        return []
    head.weight = embedding.weight
    if current_platform.is_cpu() and hasattr(head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    live = next(live for live, twin in pairs.values() if twin is head)
    return [(live, head)]


def commit(prepared: PreparedLoad, faults: LoadFaults) -> list[torch.Tensor]:
    """Moves the prepared tensors and kernel handles into the live modules (generation paused): each
    live parameter and buffer takes its twin's storage (the objects stay, so whatever holds them sees
    the version), and whatever processing set on the twin (kernel handles such as `cpu_linear`) is set
    on the live module. Returns what the live modules let go (the version before): freeing a version is
    most of a commit's time, so the caller drops it once generation is back."""
    released: list[torch.Tensor] = []
    for i, (live, twin) in enumerate(prepared.pairs):
        if faults.raise_halfway and i == len(prepared.pairs) // 2:
            log.warning("FAULT INJECTION: the load raises halfway", extra={"committed": i})
            raise RuntimeError(f"FAULT INJECTION: the load failed after {i} of {len(prepared.pairs)} layers")
        for kind in ("_parameters", "_buffers"):
            mine, theirs = getattr(live, kind), getattr(twin, kind)
            for name, tensor in theirs.items():
                held = mine.get(name)
                if tensor is None or held is tensor:
                    continue
                if held is None:
                    _bind_to(tensor.__dict__, twin, live)
                    mine[name] = tensor
                else:
                    released.append(held.data)
                    held.data = tensor.data
        moved = {key: value for key, value in twin.__dict__.items()
                 if key not in _MODULE_INTERNALS and live.__dict__.get(key) is not value}
        _bind_to(moved, twin, live)
        live.__dict__.update(moved)
    # The twins are spent. Each twin and its tensors' loader methods (bound to it) point at one another: a
    # cycle only Python's cyclic collector frees, and that runs when enough Python objects were made, not
    # bytes. Until it ran, each twin kept the storage its live module had just let go: a whole version per
    # update, the worker's growth with the twin on (docs/verification.md). Emptied, they go at once.
    for _, twin in prepared.pairs:
        twin.__dict__.clear()
    prepared.pairs.clear()
    return released


def _bind_to(attributes: dict[str, Any], twin: torch.nn.Module, live: torch.nn.Module) -> None:
    """Rebinds, in place, the methods in `attributes` bound to `twin` to `live`: a live module that kept a
    method of its twin would keep the twin, whose parameters hold the version before (each twin is a copy of
    the live module, so the next twin would keep it too), a chain of every version loaded."""
    from types import MethodType

    for key, value in attributes.items():
        if isinstance(value, MethodType) and value.__self__ is twin:
            attributes[key] = value.__func__.__get__(live)


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
