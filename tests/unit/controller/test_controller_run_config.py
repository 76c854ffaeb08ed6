"""The run configuration: one YAML file, validated up front, errors name the field."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.runtime.config import ConfigError
from services.controller.assemble import Services, build_pipeline
from services.controller.run_config import load_run_config, parse_run_config, run_config_from_yaml
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, simulated_services
from tests.unit.controller.controller_helpers import config, items

FULL = """
run: {name: gsm8k, seed: 3, max_steps: 10}
model: {name: tiny, tag: policy}
services:
  trainer: {address: 127.0.0.1:50052}
  rollout: [{address: 127.0.0.1:50053}, {address: 127.0.0.1:50063}]
  synchronizer: {address: 127.0.0.1:50051}
data:
  train: {path: TRAIN, prompt_key: question}
  validation: {path: TRAIN, prompt_key: question, shuffle: false}
worker: {type: math, group_size: 4, sampling: {temperature: 0.9, max_tokens: 64}}
reward: {name: math}
algorithm: {name: dapo, train_batch_size: 16, overlong: {penalty: true, buffer_length: 16}}
pool: {store: grouped, keys: [task]}
mode: batch-async
staleness: {threshold: 2, policy: correct}
sync: {method: memory, interval: 1}
validation: {interval: 5, before_training: true}
checkpoint: {interval: 5}
resume: {from: latest}
errors: {policy: stop_on_error}
"""


def write_train(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    return path


def test_a_whole_run_in_one_yaml_file(tmp_path: Path) -> None:
    train = write_train(tmp_path)
    file = tmp_path / "run.yaml"
    file.write_text(FULL.replace("TRAIN", str(train)))
    cfg = load_run_config(file)
    assert cfg.mode == "batch-async" and cfg.staleness_limit == 2
    assert [e.address for e in cfg.services.rollout] == ["127.0.0.1:50053", "127.0.0.1:50063"]
    assert cfg.dynamic_sampling  # on by default for dapo
    assert cfg.loss.kind == "dapo" and cfg.loss.clip_high == 0.28
    assert cfg.loss.is_cap == 2.0  # policy "correct" turns on the IS correction
    assert cfg.buffer_size_limit == 32  # twice the train batch
    assert cfg.resume.from_ == "latest"


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"worker": {"group_sise": 4}}, "worker.group_sise: unknown field"),
        ({"mode": "semi-async"}, "mode:"),
        ({"staleness": {"threshold": -1}}, "staleness.threshold"),
        ({"algorithm": {"train_batch_size": 10}}, "algorithm.train_batch_size (10) must be a multiple of worker.group_size (4)"),
        ({"validation": {"interval": 3}}, "need data.validation"),
        ({"sync": {"method": "carrier-pigeon"}}, "sync.method"),
        # The controller moves no weights: a directory of its own for them is refused, not ignored.
        ({"sync": {"checkpoint_dir": "/shared"}}, "sync.checkpoint_dir: unknown field"),
        ({"sync": {"pause_mode": "freeze"}}, "sync.pause_mode"),
        ({"services": {"synchronizer": None}}, "services.synchronizer"),
        ({"mode": "sync", "sync": {"style": "dynamic_by_explorer"}}, "sync.style: sync mode needs a fixed schedule"),
        ({"mode": "batch-async", "staleness": {"threshold": 0}, "sync": {"interval": 3}}, "staleness.threshold (0)"),
        ({"pool": {"store": "hierarchical", "keys": ["task"]}}, "pool.keys"),
        ({"worker": {"type": "agent"}}, "worker.tools"),
    ],
)
def test_bad_values_are_errors_that_name_the_field(change: dict, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(**change)
    assert names in str(err.value)


def test_data_needs_exactly_one_source() -> None:
    with pytest.raises(ConfigError, match="data.train: exactly one of path, items, hf_name"):
        parse_run_config({"data": {"train": {"items": items(4), "path": "x.jsonl"}}})


def test_yaml_text_as_the_start_rpc_sends_it() -> None:
    cfg = run_config_from_yaml("data: {train: {items: [{prompt: hi}]}}\nworker: {group_size: 1}\nalgorithm: {train_batch_size: 1}\n")
    assert cfg.pool_store == "simple"  # group size 1 needs no grouping
    with pytest.raises(ConfigError, match="not valid YAML"):
        run_config_from_yaml("data: [unclosed")


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"reward": {"name": "no_such_reward"}}, "reward.name: unknown reward 'no_such_reward'"),
        ({"worker": {"type": "no.such.module:Worker"}}, "worker.type"),
        ({"algorithm": {"name": "services.controller.batches.algorithms:nope"}}, "algorithm.name"),
        ({"data": {"train": {"items": None, "path": "/nonexistent/train.jsonl"}}}, "data.train"),
        ({"data": {"train": {"items": [{"question": "x"}]}}}, "data.train: train data: rows have no field 'prompt'"),
    ],
)
def test_names_that_do_not_resolve_fail_before_the_run_starts(change: dict, names: str) -> None:
    cfg = config(**change)
    with pytest.raises(ConfigError) as err:
        build_pipeline(cfg, simulated_services(SimulatedTrainer(), [SimulatedRolloutEngine()]))
    assert names in str(err.value)


def test_help_stays_instant_and_imports_no_torch() -> None:
    code = "import sys, runpy; sys.argv=['x','--help'];\ntry: runpy.run_module('services.controller', run_name='__main__')\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
@pytest.mark.parametrize("kind", [None, "grpo", "dapo", "ppo_clip"])
def test_the_run_and_the_trainer_default_clip_high_alike(algorithm: str, kind: str | None) -> None:
    # The controller sends clip_high resolved; a trainer asked for the same kind without one must pick the same.
    from services.trainer.config import LossConfig as TrainerLossConfig
    from services.trainer.loss_request import LossRequest, resolve_loss

    loss = {"clip_low": 0.15, **({"kind": kind} if kind else {})}
    run = config(algorithm={"name": algorithm, "train_batch_size": 8, "loss": loss}).loss
    trainer = resolve_loss(LossRequest(kind=run.kind, clip_low=run.clip_low), TrainerLossConfig())
    assert run.clip_high == trainer.clip_high
    assert (run.clip_high != run.clip_low) == (run.kind == "dapo")


@pytest.mark.parametrize("kind", ["cross_entropy", "importance_sampling"])
def test_the_rl_loop_refuses_tinkers_per_call_losses(kind: str) -> None:
    # Its batches carry group advantages and a clip range: Tinker's losses are for ForwardBackward callers.
    with pytest.raises(ConfigError, match="algorithm.loss.kind"):
        config(algorithm={"name": "grpo", "train_batch_size": 8, "loss": {"kind": kind}})
