"""Fixtures of the rollout unit tests: one tiny model and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.models.tiny import build_tiny_model
from services.rollout.engine.text import TextCodec


@pytest.fixture(scope="session")
def rollout_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout-tiny") / "model")


@pytest.fixture(scope="session")
def codec(rollout_model: Path) -> TextCodec:
    return TextCodec.load(rollout_model)
