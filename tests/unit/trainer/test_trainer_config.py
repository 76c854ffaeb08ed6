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


def test_adamw_is_fused_also_after_a_checkpoint_written_with_the_loop_and_the_same_on_any_thread_count() -> None:
    import torch

    from services.trainer.policy import build_optimizer, restore_optimizer_kernels

    def trained(threads: int, loop_checkpoint: bool) -> list[torch.Tensor]:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(0)
            model = torch.nn.Linear(577, 300)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
            optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1))
            assert all(g["fused"] is True and g["foreach"] is False for g in optimizer.param_groups)
            if loop_checkpoint:
                saved = optimizer.state_dict()
                for group in saved["param_groups"]:
                    group["fused"] = False  # as an older trainer wrote it: the per-parameter loop
                optimizer.load_state_dict(saved)
                assert not any(g["fused"] for g in optimizer.param_groups)  # what loading alone leaves
                restore_optimizer_kernels(optimizer)
                assert all(g["fused"] is True for g in optimizer.param_groups)
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                optimizer.step()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            torch.set_num_threads(previous)

    one, two = trained(1, loop_checkpoint=False), trained(2, loop_checkpoint=True)
    assert all(torch.equal(a, b) for a, b in zip(one, two))  # elementwise: no thread count changes a bit
