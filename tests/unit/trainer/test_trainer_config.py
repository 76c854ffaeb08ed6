"""Trainer configuration: instant --help, validation, learning-rate schedule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flywheel.runtime.config import ConfigError, resolve
from services.trainer.config import OptimizerConfig, TrainerConfig
from services.trainer.policy import lr_factor

PREFIX = "FLYWHEEL_TRAINER__"


def test_config_and_help_do_not_import_torch() -> None:
    code = (
        "import sys, runpy\n"
        "sys.argv = ['services.trainer', '--help']\n"
        "try:\n"
        "    runpy.run_module('services.trainer', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import before parsing'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    for flag in ("--model.lora.enabled", "--optimizer.lr", "--loss.kind", "--limits.max-batch-tokens",
                 "--checkpoint.keep-last", "--reference.preload"):
        assert flag in result.stdout, flag


def test_sections_from_env_and_cli() -> None:
    config = resolve(
        TrainerConfig,
        env={f"{PREFIX}MODEL__LORA__TARGET_MODULES": '["q_proj", "v_proj"]'},
        env_prefix=PREFIX,
        cli={"optimizer.lr": "3e-5", "loss.kind": "dapo", "checkpoint.keep_last": "3"},
    )
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    assert (config.optimizer.lr, config.loss.kind, config.checkpoint.keep_last) == (3e-5, "dapo", 3)


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"optimizer.*total_steps"):
        resolve(TrainerConfig, env={}, env_prefix=PREFIX, cli={"optimizer.schedule": "cosine"})
    with pytest.raises(ConfigError, match=r"loss\.aggregation"):
        resolve(TrainerConfig, env={}, env_prefix=PREFIX, cli={"loss.aggregation": "mean"})
    with pytest.raises(ConfigError, match=r"limits\.max_batch_tokens"):
        resolve(TrainerConfig, env={}, env_prefix=PREFIX, cli={"limits.max_batch_tokens": "0"})


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]),
        ("cosine", [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]),
    ],
)
def test_warmup_then_schedule(schedule: str, expected: list[float]) -> None:
    cfg = OptimizerConfig(warmup_steps=2, schedule=schedule, total_steps=10, min_lr_ratio=0.1)
    steps = [0, 1, 2, 6, 10, 20]
    assert [lr_factor(s, cfg) for s in steps] == pytest.approx(expected)
    if schedule == "cosine":
        assert lr_factor(4, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476))


def test_adamw_kernels_follow_the_parameters_device_also_after_a_checkpoint_from_elsewhere() -> None:
    import torch

    from services.trainer.policy import build_optimizer, restore_optimizer_kernels

    model = torch.nn.Linear(4, 4)
    optimizer, _ = build_optimizer(model, OptimizerConfig())
    assert all(g["fused"] is False and g["foreach"] is False for g in optimizer.param_groups)  # CPU: the loop
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        group["fused"] = True  # as written by a trainer on a GPU
    optimizer.load_state_dict(saved)
    assert any(g["fused"] for g in optimizer.param_groups)  # what loading alone leaves
    restore_optimizer_kernels(optimizer)
    assert all(g["fused"] is False for g in optimizer.param_groups)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # and it steps
