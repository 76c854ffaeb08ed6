"""How vLLM's engine is laid out in processes on a CPU, and the cores it computes on.

vLLM's front end (AsyncLLM, in the rollout's process) always runs its engine
core in a child process. On a CPU its platform also gives the model a worker
process of its own (the `mp` executor), so that it can set each worker's
OpenMP environment before the worker starts: three processes, each importing
torch and vLLM in turn. Where one worker serves the model (no tensor,
pipeline or data parallelism) the rollout runs it inside the engine core's
process instead, vLLM's `uni` executor, which its CPU platform keeps only
with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the front end still starts the engine
core in a child: AsyncLLM has no other way). One import of torch and vLLM
fewer: the rollout service on SmolLM2 was ready in 14.4 s against 20.2 s
(`bench/rollout.py`, bench/results/rollout.jsonl).

vLLM's executor then binds no OpenMP threads, so engine.cpu_cores is
honoured here: the engine core is spawned with one OpenMP thread per named
core, bound to those cores (OMP_NUM_THREADS, OMP_PLACES, OMP_PROC_BIND: what
vLLM's executor sets for a worker without Intel's OpenMP). With several
workers vLLM binds them itself (VLLM_CPU_OMP_THREADS_BIND, none reserved).

The variables are set in the rollout's environment only while the engine
core is spawned (it copies the environment then) and restored after: the
rollout's own OpenMP runtime read its settings when torch loaded, and no
other child should inherit them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

#: Set by the user, this keeps vLLM's own process layout whatever the rollout would choose.
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
_PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def one_worker(args: Mapping[str, Any]) -> bool:
    """Whether engine.args leave the model to a single worker (no tensor, pipeline or data parallelism)."""
    return all(int(args.get(name) or 1) == 1 for name in _PARALLEL)


def engine_core_environment(cores: list[int] | None, args: Mapping[str, Any],
                            environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables vLLM's engine core is spawned with on a CPU: `cores` is engine.cpu_cores (None: not
    named), `args` engine.args, `environ` the rollout's environment (a layout the user chose there is kept)."""
    named = ",".join(map(str, cores)) if cores is not None else None
    kept_by_user = environ.get(MULTIPROCESSING) not in (None, "0")
    if kept_by_user or not one_worker(args):
        # vLLM's executor starts the workers and binds each to a list of cores.
        return {} if named is None else {"VLLM_CPU_OMP_THREADS_BIND": named, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    variables = {MULTIPROCESSING: "0"}
    if cores is not None:
        variables.update(OMP_NUM_THREADS=str(len(cores)), OMP_PLACES=f"{{{named}}}", OMP_PROC_BIND="true")
    return variables


@contextlib.contextmanager
def spawned_with(variables: Mapping[str, str]) -> Iterator[None]:
    """`variables` in this process's environment for the block (the engine core's spawn), then as they were."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
