"""Shared fixtures: real service processes on free ports, and tiny models."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flywheel.launcher.preloaded import PRELOADED_ENV
from flywheel.launcher.processes import ServiceProcess, start_service
from flywheel.runtime.triton_gate import keep_triton_out

# As in every service (flywheel/runtime/entry.py): tests that run engines in this process would
# otherwise end the session with triton's nanobind leak report.
keep_triton_out()

#: Services start as forks of a preloaded interpreter (tests/preloaded.py);
#: FLYWHEEL_TEST_CPU_REPORT=cpu.tsv: each module's wall and CPU time (tests/cpu_share.py); a test about to
#: time out writes what its event loop's tasks wait for (tests/hang_report.py).
pytest_plugins = ["tests.preloaded", "tests.cpu_share", "tests.hang_report"]

#: `make test` runs the suite on two pytest-xdist workers (`-n 2`): a vLLM replica starting, a launcher
#: waiting on its services or a test waiting out a deadline leaves a core idle that a test beside it
#: uses. Each module is one unit of work, on one worker (its module-scoped services start once), the
#: slowest first (their seconds alone: a serial run on the 2-core EPYC at 026384c), so that none of them
#: is left running alone at the end.
SLOWEST_FIRST = (
    "tests/deploy/test_kubernetes_cluster.py",  # 165, and the compose cluster (125): one unit
    "tests/integration/test_quickstart_tiny.py",  # 211
    "tests/integration/test_bench_smokes.py",  # 205
    "tests/integration/test_modes_with_real_services.py",  # 181
    "tests/integration/test_sampling_contract.py",  # 117
    "tests/integration/test_deployed_healing.py",  # 66
    "tests/integration/test_services_start.py",  # 62
    "tests/integration/test_tinker_gateway.py",  # 55
    "tests/integration/test_fleet_updates.py",  # 54
    "tests/integration/test_tinker_cookbook.py",  # 52
    "tests/deploy/test_live.py",  # 49
)
#: Each starts a whole cluster (two vLLM replicas, trainer, synchronizer, controller): one at a time.
CLUSTERS = ("tests/deploy/test_kubernetes_cluster.py", "tests/deploy/test_compose_cluster.py")


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to under `-n`: its module, the cluster modules one unit."""
    module = nodeid.split("::")[0]
    return CLUSTERS[0] if module in CLUSTERS else module


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: in the controlling process, under -n
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the units in collection order: the slowest first (below)
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: its collection is the order units are handed out
        first = {unit: rank for rank, unit in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: first.get(_unit(item.nodeid), len(first)))  # stable: the rest keep theirs


TEST_TOKEN = "test-token-123"

# The tests run several torch processes (trainer, replicas, controller) on two cores. libgomp's OpenMP
# threads spin-wait after each parallel region by default, taking the core from the other processes; on
# an Intel Xeon (where PAUSE is slow) test_elastic_replicas.py took 729 s, and 101 s with idle threads
# asleep. Every process the tests start inherits this (the deploy harness hands it to each host: cluster.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every service the tests start imports torch, many import vLLM too: without cached bytecode each one
# compiles them (and our own modules) from source again. Where PYTHONDONTWRITEBYTECODE is set (this
# kind of machine sets it, CI included) nothing is ever cached: .ci/run compiles the installed packages
# once, but this repository's modules, or everything on a machine where nobody ran compileall, were
# compiled anew by each of the suite's hundreds of processes. Here the first one caches them. Measured on
# 2 cores, back to back: the tiny quickstart (vLLM) 54 s with nothing cached, 26 s cached; `import
# vllm.v1.engine.core`, which each of a vLLM replica's three processes pays, 12.4 s of CPU uncached, 6.0 s.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture
def service_env() -> dict[str, str]:
    """The environment children get: ours, minus any Flywheel settings, plus a known token. The preloaded
    interpreter stays named (tests/preloaded.py): a launcher started with it forks its services from it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_") or k == PRELOADED_ENV}
    env["FLYWHEEL_AUTH_TOKEN"] = TEST_TOKEN
    return env


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model for services that need one to start (trainer, rollout)."""
    from flywheel.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("service-model") / "policy", max_position_embeddings=512)


#: The flags that give a service its model (the transformers engine: quick to start).
MODEL_FLAGS = {
    "trainer": lambda model: ("--model.path", str(model)),
    "rollout": lambda model: ("--engine.model-path", str(model), "--engine.kind", "transformers", "--http-port", "0"),
}


@pytest.fixture
def run_service(
    tmp_path: Path, service_env: dict[str, str], service_model: Path
) -> Iterator[Callable[..., ServiceProcess]]:
    """Starts `python -m services.<name>` (trainer and rollout with a tiny model) and waits
    until it is SERVING; stops it afterwards."""
    started: list[ServiceProcess] = []

    def run(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> ServiceProcess:
        model_args = MODEL_FLAGS[name](service_model) if name in MODEL_FLAGS and "model" not in " ".join(args) else ()
        if name == "trainer" and "--checkpoint.dir" not in args:
            # Its default is relative to the working directory: the repository, when tests run.
            model_args = (*model_args, "--checkpoint.dir", str(tmp_path / "run" / "checkpoints"))
        # Paths in requests must lie inside these (flywheel.runtime.paths); tests keep their files in tmp_path.
        root_flag = {"synchronizer": "--checkpoint-root", "rollout": "--updates.checkpoint-root"}.get(name)
        if root_flag and root_flag not in args:
            model_args = (*model_args, root_flag, str(tmp_path))
        if name == "controller" and "--status-port" not in args:
            # Its status page's default port (8080) is what a launcher beside it on the other worker takes.
            model_args = (*model_args, "--status-port", "0")
        child = start_service(name, tmp_path / "run", (*model_args, *args), env or service_env)
        started.append(child)
        child.wait_ready(timeout)
        return child

    yield run
    for child in reversed(started):  # the last first: a service that registered with one before it deregisters
        child.stop()
