"""engine.cpu_cores: which cores the inference engine computes on, handed to the engine it creates;
and where vLLM's model runs on a CPU (services/rollout/engine/vllm_cpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

import services.rollout.engine as engines
from services.rollout.config import EngineConfig, RolloutConfig
from services.rollout.engine.vllm_cpu import engine_core_environment, one_worker, spawned_with


def test_core_lists_are_parsed_and_bad_ones_refused() -> None:
    assert EngineConfig(cpu_cores="0-2,5").cores() == [0, 1, 2, 5]
    assert EngineConfig(cpu_cores="all").cores() == sorted(os.sched_getaffinity(0))
    assert EngineConfig().cores() is None
    for bad in ("3-1", "x", "0,,1", "-1"):
        with pytest.raises(ValidationError, match="cpu_cores"):
            EngineConfig(cpu_cores=bad)


def _config(kind: str, cores: str) -> RolloutConfig:
    return RolloutConfig.model_validate({"engine": {"kind": kind, "model_path": "/nonexistent", "cpu_cores": cores}})


def test_one_worker_serves_the_model_inside_the_engine_core_bound_to_the_named_cores() -> None:
    assert engine_core_environment([0, 1, 3], {}, environ={}) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "3", "OMP_PLACES": "{0,1,3}", "OMP_PROC_BIND": "true"}
    # No cores named: OpenMP's default, in the same one process.
    assert engine_core_environment(None, {"tensor_parallel_size": 1}, environ={}) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_several_workers_are_bound_by_vllm_with_none_reserved() -> None:
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"data_parallel_size": 2}):
        assert not one_worker(parallel)
        assert engine_core_environment([0, 1], parallel, environ={}) == {
            "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        assert engine_core_environment(None, parallel, environ={}) == {}, "no cores named: vLLM's own binding"


def test_a_process_layout_the_user_chose_is_kept() -> None:
    assert engine_core_environment([0], {}, environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert engine_core_environment(None, {}, environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_the_variables_hold_only_while_the_engine_core_is_spawned(monkeypatch) -> None:
    monkeypatch.setenv("OMP_PLACES", "{7}")
    monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    with spawned_with({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}):
        assert (os.environ["OMP_PLACES"], os.environ["OMP_PROC_BIND"]) == ("{0,1}", "true")
    assert os.environ["OMP_PLACES"] == "{7}" and "OMP_PROC_BIND" not in os.environ


def test_creating_a_vllm_engine_hands_it_the_named_cores_and_sets_no_variable(monkeypatch) -> None:
    names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
             "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    made = engines.create_engine(_config("vllm", "0-1"), codec=None)  # created, not started: nothing is loaded
    assert made._cores == [0, 1]
    assert engines.create_engine(_config("vllm", ""), codec=None)._cores is None
    assert [name for name in names if name in os.environ] == []


def test_the_transformers_engine_runs_one_thread_per_named_core(monkeypatch) -> None:
    # Spied rather than read back: what torch.get_num_threads reports depends on the OpenMP runtime's
    # state, which earlier tests in the same process may have changed.
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    engines.create_engine(_config("transformers", "0,2-3"), codec=None)
    assert asked == [3]
    engines.create_engine(_config("transformers", ""), codec=None)
    assert asked == [3], "no cores named: torch's default is kept"
