"""The versions of a real run, for benches that need consecutive weights as training makes them
(delta sizes, far transfers): the first steps of the (tiny) quickstart with a checkpoint after
every step, read back as state dicts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from flywheel.testing.engines import with_transformers_engine

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
QUICKSTART_TINY = ROOT / "examples" / "quickstart-tiny.yaml"


def make_run(smoke: bool, steps: int, work: Path) -> Path:
    """Runs the (tiny) quickstart for `steps` steps with a checkpoint after each; returns its run directory."""
    config = yaml.safe_load((QUICKSTART_TINY if smoke else QUICKSTART).read_text())
    if smoke:  # the versions are what counts, not the engine that sampled for them
        with_transformers_engine(config)
    # The first `steps` steps of the job as it runs: a decaying learning rate keeps the job's own length
    # (decayed over `steps` instead, the later steps would be smaller than the job's).
    optimizer = config["launch"].setdefault("trainer", {}).setdefault("optimizer", {})
    if optimizer.get("schedule", "constant") != "constant":
        optimizer.setdefault("total_steps", config["run"]["max_steps"])
    config["run"]["max_steps"] = steps
    config["checkpoint"] = {"interval": 1, "at_end": True}
    config["validation"] = {"before_training": False, "interval": 0}
    job, run_dir = work / "job.yaml", work / "run"
    job.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "services.controller", "run", str(job), "--run-dir", str(run_dir),
               "--resume", "disable"]
    proc = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return run_dir


def versions(run_dir: Path) -> list[tuple[int, Path]]:
    """(version, HF model directory), version 0 being the model the run started from."""
    from safetensors import safe_open  # noqa: F401 - fail early without safetensors

    steps = sorted((int(p.name.split("_")[-1]), p / "model") for p in (run_dir / "checkpoints").glob("global_step_*")
                   if (p / "trainer_state.json").exists())
    trainer = yaml.safe_load((run_dir / "trainer.yaml").read_text())
    return [(0, Path(trainer["model"]["path"])), *steps]


def load(model_dir: Path, dtype) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(file))
    return {name: tensor.to(dtype).contiguous() for name, tensor in sorted(state.items())}
