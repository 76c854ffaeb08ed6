"""Sync vs fully-async with real services: does overlap pay off?

Run manual:
    python bench/modes.py                  # 20 steps per mode, ~4 minutes on 2 cores
    python bench/modes.py --steps 10 --no-pin
    python bench/modes.py --smoke          # 3 steps per mode: checks it runs (CI)

What runs, for each mode (sync first, then fully-async), from scratch: a real
synchronizer, trainer and rollout (the tiny quickstart model; vLLM on CPU when
installed, else the transformers engine; --smoke: the transformers engine) as separate processes, and the
controller driving them with the synchronizer's policy FIXED(1, 0) and MEMORY
weights. The trainer and the rollout get one core each (`taskset`, --no-pin to
share all cores): on shared cores, overlapping generation with training has
nowhere to run, and the comparison measures the scheduler. The synchronizer and
the controller share the rollout's core (they are light).

Reported per mode: trained samples/s over the run (from the controller's
summary: first batch to end), trainer idle fraction (no TrainStep running),
mean staleness of trained samples, and wall seconds of the run. Ends with one
JSON line; the ratios are `fully_async_vs_sync` (samples/s) and
`fully_async_idle_vs_sync` (trainer idle fraction).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from services.controller.launcher.prepare import prepare_model  # noqa: E402
from flywheel.launcher.processes import ServiceProcess, start_service  # noqa: E402
from services.controller.launcher.spec import ModelSource  # noqa: E402
from flywheel.testing.engines import with_transformers_engine  # noqa: E402
from flywheel.testing.records import record  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=20, help="trainer steps per mode")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the trainer and the rollout to cores")
    return parse_with_smoke(ap, "3 steps per mode: checks the bench runs (CI)", steps=3)


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pinned(core: int | None, directory: Path) -> str:
    """A Python that runs on `core` only (a tiny wrapper script in `directory`: start_service takes an
    interpreter)."""
    if core is None or shutil.which("taskset") is None:
        return sys.executable
    wrapper = directory / "python"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {core} {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def start(kind: str, directory: Path, config: dict, core: int | None) -> ServiceProcess:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return start_service(kind, directory, ["--config", str(directory / "config.yaml")], python=pinned(core, directory))


def run_mode(mode: str, steps: int, model: Path, work: Path, pin: bool, smoke: bool) -> dict:
    trainer_core, rollout_core = (cores()[0], cores()[-1]) if pin and len(cores()) > 1 else (None, None)
    quick = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    children: list[ServiceProcess] = []
    try:
        sync = start("synchronizer", work / "synchronizer", {}, rollout_core)
        children.append(sync)
        sync.wait_ready(60)
        children.append(start("trainer", work / "trainer", {
            "model": {"path": str(model), "cpu_threads": 1},
            "optimizer": quick["launch"]["trainer"]["optimizer"],
            "checkpoint": {"dir": str(work / "checkpoints")},
            "sync": {"synchronizer_address": sync.grpc_address},
        }, trainer_core))
        if smoke:  # checks the bench runs: the transformers engine starts in seconds, vLLM in 30 s on a core
            with_transformers_engine(quick)
        engine = dict(quick["launch"]["rollout"]["engine"])
        engine["args"] = {**engine["args"], "dtype": "float32"}
        children.append(start("rollout", work / "rollout", {
            "http_port": 0, "engine": {**engine, "model_path": str(model)},
            "synchronizer": {"address": sync.grpc_address, "component_id": "rollout-0"},
        }, rollout_core))
        for child in children[1:]:
            child.wait_ready(600)
        run = {k: v for k, v in quick.items() if k != "launch"}
        # With `services:` the controller keeps its configured ports, as a container does; here they are
        # free ones, so that a run of another bench or test on this machine cannot hold them.
        run["launch"] = {"dataset": {**quick["launch"]["dataset"], "train_size": 4 * steps},
                         "controller": {"status_port": 0, "server": {"port": 0, "metrics_port": 0}}}
        run["run"].update(name=f"bench-{mode}", max_steps=steps)
        run.update(mode=mode, resume="disable", sync={"method": "memory", "interval": 1},
                   validation={"before_training": False, "interval": 0},
                   checkpoint={"interval": 0, "at_end": False},
                   services={"synchronizer": {"address": sync.grpc_address},
                             "trainer": {"address": children[1].grpc_address, "timeout_seconds": 600}})
        run_file = work / f"{mode}.yaml"
        run_file.write_text(yaml.safe_dump(run))
        run_dir = work / f"run-{mode}"
        started = time.perf_counter()
        controller = [sys.executable, "-m", "services.controller", "run", str(run_file), "--run-dir", str(run_dir)]
        if rollout_core is not None and shutil.which("taskset"):
            controller = ["taskset", "-c", str(rollout_core), *controller]
        proc = subprocess.run(controller, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "trained_tasks.jsonl").read_text().splitlines()]
        stale = [r["trained_version"] - s for r in rows for s, _ in r["sample_versions"]]
        return {
            "samples_per_second": summary["samples_per_second"],
            "trainer_idle_fraction": summary["trainer_idle_fraction"],
            "staleness_mean": sum(stale) / len(stale),
            "wall_seconds": wall,
        }
    finally:
        for child in reversed(children):
            child.stop(grace=10)


def main() -> None:
    args = parse_args()
    quick = yaml.safe_load((ROOT / "examples" / "quickstart-tiny.yaml").read_text())
    model = prepare_model(ModelSource(**quick["launch"]["model"]))
    pin = not args.no_pin
    print(f"tiny model {model}; {args.steps} steps per mode; cores {cores()}; "
          f"{'trainer and rollout pinned to one core each' if pin else 'shared cores'}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "fully-async"):
            results[mode] = run_mode(mode, args.steps, model, Path(tmp) / mode, pin, args.smoke)
    print(f"{'mode':<12} {'samples/s':>10} {'trainer idle':>13} {'staleness':>10} {'wall s':>8}")
    for mode, r in results.items():
        print(f"{mode:<12} {r['samples_per_second']:>10.2f} {r['trainer_idle_fraction']:>13.2f} "
              f"{r['staleness_mean']:>10.2f} {r['wall_seconds']:>8.1f}")
    sync, fully = results["sync"], results["fully-async"]
    record("modes", {
        "bench": "modes", "steps": args.steps, "pinned": pin,
        "sync_samples_per_second": round(sync["samples_per_second"], 3),
        "fully_async_samples_per_second": round(fully["samples_per_second"], 3),
        "sync_trainer_idle_fraction": round(sync["trainer_idle_fraction"], 3),
        "fully_async_trainer_idle_fraction": round(fully["trainer_idle_fraction"], 3),
        "fully_async_vs_sync": round(fully["samples_per_second"] / sync["samples_per_second"], 3),
        "fully_async_idle_vs_sync": round(fully["trainer_idle_fraction"] / max(sync["trainer_idle_fraction"], 1e-9), 3),
    }, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
