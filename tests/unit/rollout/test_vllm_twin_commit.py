"""A prepared version's commit (services/rollout/engine/vllm_load.commit) leaves the live model holding
nothing of the twin it was loaded into: the twin, and the tensors of the version before that it holds,
are freed once the commit is done. Plain torch modules stand in for vLLM's layers (what commit touches:
parameters, buffers and attributes, some of them methods bound to the module)."""

from __future__ import annotations

import copy
import gc
import weakref

import torch

from services.rollout.engine.base import LoadFaults
from services.rollout.engine.vllm_load import PreparedLoad, commit


class Layer(torch.nn.Module):
    """A layer as vLLM leaves one after loading: a weight, a kernel handle set by its processing and a
    loader method bound to the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.kernel = self.forward_packed
        self.extra_loader = None

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def twin_of(live: Layer, value: float) -> Layer:
    """What prepare_twin makes of a version: a copy with parameters of its own, loaded and processed."""
    twin = copy.copy(live)
    twin._parameters = {"weight": torch.nn.Parameter(torch.full((4, 4), value), requires_grad=False)}
    twin.__dict__["kernel"] = twin.forward_packed  # processing set on the twin
    extra = torch.nn.Parameter(torch.full((2,), value), requires_grad=False)
    extra.weight_loader = twin.forward_packed  # a parameter the live layer lacks, with a loader of the twin
    twin._parameters["extra"] = extra
    return twin


def test_a_committed_twin_is_freed_and_the_live_layer_serves_its_version() -> None:
    live = Layer()
    twins = []
    for version in (1.0, 2.0, 3.0):
        twin = twin_of(live, version)
        twins.append(weakref.ref(twin))
        commit(PreparedLoad([(live, twin)]), LoadFaults())
        del twin
        gc.collect()
        assert float(live.weight[0, 0]) == version
        assert float(live.kernel(torch.eye(4))[0, 0]) == version  # the kernel reads the live weights
        assert live.kernel.__self__ is live and live.extra.weight_loader.__self__ is live
    # Nothing keeps a committed twin: not the live layer, not the twins after it.
    assert [ref() for ref in twins] == [None, None, None]


def test_a_committed_twin_goes_at_once_without_the_cyclic_collector() -> None:
    """A twin and its methods point at one another; Python's cyclic collector runs rarely (it counts objects,
    not bytes), and until it did each twin kept the storage its live layer had just let go: the vLLM worker
    grew by a version per update. The commit empties the twins, so reference counting frees them."""
    live = Layer()
    gc.collect()
    gc.disable()
    try:
        twin = twin_of(live, 1.0)
        twin_ref, old_weight = weakref.ref(twin), weakref.ref(live.weight)
        before = live.weight.data
        commit(PreparedLoad([(live, twin)]), LoadFaults())
        del twin
        assert twin_ref() is None
        first = live.weight.data.data_ptr()  # version 1's storage, which the next commit lets go
        twin = twin_of(live, 2.0)
        held_by_twin = weakref.ref(twin._parameters["weight"])
        released = commit(PreparedLoad([(live, twin)]), LoadFaults())
        del twin
        assert held_by_twin() is None  # the twin went: only the live layer and `released` hold tensors now
        assert old_weight() is live.weight and before.data_ptr() != live.weight.data_ptr()
        # What the live layer let go is handed back, to be freed outside generation's pause.
        assert [t.data_ptr() for t in released][0] == first and len(released) == 2  # its weight and extra
    finally:
        gc.enable()
