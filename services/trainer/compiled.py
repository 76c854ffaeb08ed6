"""`model.compile`: each decoder layer's forward compiled by torch.compile (inductor).

On a GPU a step of a small model is bound by the host: bench/gpu.py's profile of
the 0.5B model (docs/gpu.md, 2026-11-27) had the device busy for 82-87 ms of a
207-270 ms step, the rest Python and kernel launches, most of them the small
elementwise operations of each layer (norms, rotary embeddings, activations).
Compiling the layers fuses those: on an H200 the step then ran at 1.07 of a plain
torch step's speed, against 0.85 eager in the same run (docs/gpu.md, d4b676d).

What is compiled is each layer's `forward`, not the layer: FSDP2's hooks (which
gather a sharded layer's parameters) stay around it, and the parameters keep their
names, which checkpoints, exports and the synchronizer's digests use (wrapping the
module would prefix them with `_orig_mod.`). Every layer runs the same code, so
they share their compiled graphs (torch's `inline_inbuilt_nn_modules`, on by default:
a module's parameters are the graph's inputs, not constants guarded by identity; a
step of the tiny model captured one graph with 2 layers and one with 4). The output head and
the loss stay eager: the head runs only over the loss mask's positions, in chunks
(services.trainer.forward), a shape that changes with every batch.
"""

from __future__ import annotations

import torch
from torch import nn

from flywheel.errors import FailedPrecondition
from flywheel.models.moe import routers
from services.trainer.distributed import decoder_layers

#: torch.compile's backend. The unit tests on CPU swap in "aot_eager" (the same capture, eager kernels):
#: inductor's C++ build of one layer takes about a minute on one core of a 2-core machine.
BACKEND = "inductor"


def compile_layers(model: nn.Module) -> None:
    """Compiles every decoder layer's forward of `model` in place (lazily: at its first call).
    Refuses a mixture-of-experts model: routing replay adds hooks to its
    routers and removes them at every forward, which compiled layers have not been tried with."""
    if routers(model):
        raise FailedPrecondition(
            "model.compile: not supported for mixture-of-experts models (routing replay hooks their routers "
            "at every forward, untried with compiled layers); turn it off")
    for layer in decoder_layers(model):
        # dynamic=None: the first shape compiles static, a second recompiles with dynamic sizes once
        # (sequence length and rows change from batch to batch).
        layer.forward = torch.compile(layer.forward, backend=BACKEND, dynamic=None)
