"""FAULT INJECTION for the tests of an update's verification: which tensors
each load fault of `LoadFaults` hits, chosen the same way by every engine
from the checkpoint's names, dtypes and shapes (never used by the product).

- readable: a tensor every engine keeps as the checkpoint holds it (a norm,
  else the token embedding), so that reading it back can catch it;
- linear: the weight of a linear layer (an MLP's down projection first: its
  output goes straight into the residual stream), which vLLM on CPU repacks
  and cannot read back;
- swapped: two linear weights of one shape and dtype (the attention's
  query and output projections first), as a loader that mapped a name to the
  wrong parameter would load them;
- skipped: a linear weight the load leaves at the previous version: one
  that vLLM fuses with another (an MLP's up projection, loaded beside its
  gate projection), as a loader that lost one shard of a fused layer would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.rollout.engine.base import TensorSpec


@dataclass(frozen=True)
class FaultTargets:
    readable: str
    linear: str
    swapped: tuple[str, str] | None
    skipped: str


def _linear(specs: Mapping[str, TensorSpec]) -> list[str]:
    return [n for n, s in specs.items() if len(s.shape) == 2 and n.endswith("_proj.weight")]


def fault_targets(specs: Mapping[str, TensorSpec]) -> FaultTargets:
    linear = _linear(specs) or [n for n, s in specs.items() if len(s.shape) == 2]
    if not linear:
        raise ValueError("the model has no linear layer to inject a fault into")
    norms = [n for n, s in specs.items() if len(s.shape) == 1 and "norm" in n]
    readable = norms[0] if norms else next(n for n in specs if "embed" in n)
    down = [n for n in linear if "down_proj" in n]
    swapped = None
    by_shape: dict[tuple, list[str]] = {}
    for name in linear:
        by_shape.setdefault((specs[name].dtype, specs[name].shape), []).append(name)
    preferred = [n for n in linear if "q_proj" in n or "o_proj" in n]
    for group in sorted(by_shape.values(), key=lambda g: -sum(n in preferred for n in g)):
        if len(group) >= 2:
            swapped = (group[0], group[1])
            break
    up = [n for n in linear if "up_proj" in n]
    return FaultTargets(readable=readable, linear=(down or linear)[0], swapped=swapped, skipped=(up or linear)[-1])
