"""LoRA adapters served beside one another on the transformers engine's one model.

Each adapted module (a linear layer) gets one forward hook, installed the first
time an adapter names it, that adds scale * x A^T B^T of the adapter the
current forward samples with to the module's output. The engine runs one
sequence per forward on its one model thread and names that sequence's adapter
(`active`) before each forward, so sequences of different adapters, and of the
base, interleave step by step without any weight being written: adding or
removing an adapter never pauses the others. The base weights stay what an
update installed, under their checkpoint names; weight updates and their
verification see exactly the model they saw without adapters.
"""

from __future__ import annotations

from typing import Any

import torch

from flywheel.errors import FailedPrecondition
from services.rollout.engine.base import AdapterWeights


class AdapterHooks:
    """The adapters resident on one model and the hooks that apply them (used on the model's thread only)."""

    def __init__(self, model: Any) -> None:
        self._modules = dict(model.named_modules())
        self._dtype = next(model.parameters()).dtype
        #: module name -> adapter name -> (A, B, scale)
        self._layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._hooks: dict[str, Any] = {}
        #: The adapter the next forward samples with; None: the base weights.
        self.active: str | None = None

    def add(self, adapter: AdapterWeights) -> None:
        unknown = [name for name in adapter.layers if not isinstance(self._modules.get(name), torch.nn.Linear)]
        if unknown:
            raise FailedPrecondition(f"adapter {adapter.name[:16]}: no linear layer of the model is named "
                                     f"{', '.join(unknown[:3])}")
        for name, (a, b, scale) in adapter.layers.items():
            module = self._modules[name]
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                raise FailedPrecondition(f"adapter {adapter.name[:16]}: {name} is {module.in_features} -> "
                                         f"{module.out_features}, its A and B are {tuple(a.shape)} and {tuple(b.shape)}")
        for name, (a, b, scale) in adapter.layers.items():
            device = self._modules[name].weight.device
            self._layers.setdefault(name, {})[adapter.name] = (a.to(device, self._dtype), b.to(device, self._dtype), scale)
            if name not in self._hooks:
                self._hooks[name] = self._modules[name].register_forward_hook(self._hook(name))

    def remove(self, name: str) -> None:
        for module, adapters in list(self._layers.items()):
            adapters.pop(name, None)
            if not adapters:  # the last adapter of this module: its forward is the bare layer again
                del self._layers[module]
                self._hooks.pop(module).remove()

    def _hook(self, module_name: str):
        def apply(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            weights = self._layers.get(module_name, {}).get(self.active) if self.active is not None else None
            if weights is None:
                return output
            a, b, scale = weights
            return output + (inputs[0] @ a.T) @ b.T * scale

        return apply
