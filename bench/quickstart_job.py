"""The quickstart's job as the benches that compare training recipes on it run it (bench/distill.py,
bench/environments.py): the run file edited, the local launcher started on it from scratch, its
validation curve read back."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from flywheel.testing.engines import with_transformers_engine

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
QUICKSTART_TINY = ROOT / "examples" / "quickstart-tiny.yaml"
#: Questions in a smoke's validation, and groups (questions) in a smoke's training step (`run_job`).
SMOKE_VALIDATION = 4
SMOKE_GROUPS = 2


@contextlib.contextmanager
def work_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """Where a bench's runs go: `given` (`--work`), kept for reading afterwards, else a temporary
    directory that is removed when the bench ends, unless it failed: then its services' logs are
    what tells why, and the directory is kept and named."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    made = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield made
    except BaseException:
        print(f"the bench failed; its runs are kept in {made}", file=sys.stderr)
        raise
    shutil.rmtree(made, ignore_errors=True)


def run_job(base: Path, work: Path, name: str, steps: int, val_interval: int | None,
            edit: dict[str, Any] | None = None, drop: tuple[str, ...] = (), checkpoint: bool = True,
            smoke: bool = False) -> Path:
    """Runs the job of run file `base` for `steps` steps, validating before training and every
    `val_interval` (None: never), its sections merged with `edit` and those in `drop` left out, with a
    checkpoint at the end unless `checkpoint` is False; returns its run directory. `smoke`: a bench's
    --smoke, which checks that the bench runs: the rollout then uses the transformers engine, as the
    tests do where the engine is not their subject (vLLM's start would be most of a smoke's time), and
    validation asks `SMOKE_VALIDATION` questions and a step trains `SMOKE_GROUPS` groups."""
    config = yaml.safe_load(base.read_text())
    config["run"]["max_steps"] = steps
    config["validation"] = ({**config.get("validation", {}), "before_training": True, "interval": val_interval}
                            if val_interval is not None else {"before_training": False, "interval": 0})
    config["checkpoint"] = {"interval": 0, "at_end": checkpoint}
    # A free port for the status page: 8080 (the default) may be another run's, or a test's beside a smoke.
    config.setdefault("launch", {}).setdefault("controller", {})["status_port"] = 0
    for section, values in (edit or {}).items():
        config[section] = {**config.get(section, {}), **values}
    for section in drop:
        config.pop(section, None)
    if smoke:
        with_transformers_engine(config)
        # A validation of 4 questions: a smoke's curves are read only for being there (the tiny random
        # model learns nothing), and each question is an episode, on an environment's side a program started.
        dataset = config.get("launch", {}).get("dataset")
        if dataset is not None:
            dataset["validation_size"] = min(dataset.get("validation_size", SMOKE_VALIDATION), SMOKE_VALIDATION)
        # Two groups a step, for the same reason: on an environment's side every sample is an episode too.
        algorithm = config.setdefault("algorithm", {})
        smoke_batch = SMOKE_GROUPS * int(config.get("worker", {}).get("group_size", 1))
        algorithm["train_batch_size"] = min(int(algorithm.get("train_batch_size", smoke_batch)), smoke_batch)
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "services.controller", "run", str(path), "--run-dir", str(run_dir),
               "--resume", "disable"]
    print(f"{name}: {' '.join(command)}", file=sys.stderr, flush=True)
    proc = subprocess.run(command, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return run_dir


def curve(run_dir: Path) -> dict[int, float]:
    """The run's held-out accuracy by step (step 0: before training)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {int(v["step"]): float(v["value"]) for v in summary["validation"]["history"]}


def first_step(points: dict[int, float], goal: float) -> int | None:
    """The first step at which the curve reached `goal` (None: never)."""
    return next((step for step, value in sorted(points.items()) if value >= goal - 1e-9), None)


def step_seconds(run_dir: Path) -> float:
    """The mean wall seconds of a training step (validations left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_seconds"] for r in rows if "time/step_seconds" in r and "rollout/reward_mean" in r]
    return sum(steps) / len(steps)


def section(base: Path, name: str) -> dict[str, Any]:
    """A section of run file `base`, to edit and merge back."""
    return dict(yaml.safe_load(base.read_text()).get(name) or {})
