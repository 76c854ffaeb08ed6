"""A service without a usable model refuses to start, naming the setting; the
deployments' first-start step leaves a model on the shared volume once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.models.check import require_model_dir
from flywheel.runtime.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_missing_or_wrong_model_paths_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.path \(env FLYWHEEL_TRAINER__MODEL__PATH\) is not set"):
        require_model_dir(None, "trainer", ("model", "path"))
    with pytest.raises(ConfigError, match=r"engine\.model_path .*FLYWHEEL_ROLLOUT__ENGINE__MODEL_PATH.*no such directory"):
        require_model_dir(tmp_path / "absent", "rollout", ("engine", "model_path"))
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        require_model_dir(tmp_path, "rollout", ("engine", "model_path"))
    (tmp_path / "config.json").write_text("{}")
    assert require_model_dir(str(tmp_path), "rollout", ("engine", "model_path")) == tmp_path


@pytest.mark.parametrize("service, flag", [("trainer", "--model.path"), ("rollout", "--engine.model-path")])
def test_a_service_with_a_wrong_model_path_exits_before_serving(tmp_path: Path, service: str, flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{service}", flag, str(tmp_path / "nope"), "--server.port", "0",
         "--server.metrics-port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def test_init_leaves_a_model_once_and_checks_a_given_one(tmp_path: Path) -> None:
    def init(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flywheel.models", "init", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "models" / "policy"
    first = init("tiny", str(out))
    assert first.returncode == 0, first.stderr
    assert (out / "config.json").is_file() and not list(out.parent.glob(".policy.tmp-*"))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = init("tiny", str(out))
    assert again.returncode == 0 and "already holds a model" in again.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # a restart does not rebuild
    assert init("path", str(out)).returncode == 0
    missing = init("path", str(tmp_path / "empty"))
    assert missing.returncode == 2 and "holds no model" in missing.stderr
