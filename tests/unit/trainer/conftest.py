"""Fixtures of the trainer's unit tests: a tiny model and engines on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.models.tiny import build_tiny_model
from services.trainer.config import TrainerConfig
from services.trainer.training import TrainingEngine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def make_engine(tiny_model: Path, tmp_path: Path):
    """make_engine(**sections) -> a loaded engine; sections override the config."""

    def make(**sections) -> TrainingEngine:
        data = {
            "model": {"path": str(tiny_model)},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
        }
        for key, value in sections.items():
            data.setdefault(key, {}).update(value)
        engine = TrainingEngine(TrainerConfig.model_validate(data))
        engine.load()
        return engine

    return make

