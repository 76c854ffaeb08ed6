"""engine.cpu_cores: which cores the inference engine computes on, handed to the engine it creates."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

import services.rollout.engine as engines
from services.rollout.config import EngineConfig, RolloutConfig


def test_core_lists_are_parsed_and_bad_ones_refused() -> None:
    assert EngineConfig(cpu_cores="0-2,5").cores() == [0, 1, 2, 5]
    assert EngineConfig(cpu_cores="all").cores() == sorted(os.sched_getaffinity(0))
    assert EngineConfig().cores() is None
    for bad in ("3-1", "x", "0,,1", "-1"):
        with pytest.raises(ValidationError, match="cpu_cores"):
            EngineConfig(cpu_cores=bad)


def _config(kind: str, cores: str) -> RolloutConfig:
    return RolloutConfig.model_validate({"engine": {"kind": kind, "model_path": "/nonexistent", "cpu_cores": cores}})


def test_vllm_is_bound_to_the_named_cores_with_none_reserved(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    engines.create_engine(_config("vllm", "0-1"), codec=None)  # created, not started: nothing is loaded
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_vllm_keeps_its_own_binding_when_no_cores_are_named(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    engines.create_engine(_config("vllm", ""), codec=None)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_the_transformers_engine_runs_one_thread_per_named_core(monkeypatch) -> None:
    # Spied rather than read back: what torch.get_num_threads reports depends on the OpenMP runtime's
    # state, which earlier tests in the same process may have changed.
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    engines.create_engine(_config("transformers", "0,2-3"), codec=None)
    assert asked == [3]
    engines.create_engine(_config("transformers", ""), codec=None)
    assert asked == [3], "no cores named: torch's default is kept"
