"""The quickstart's job played in an environment service (an OpenEnv server, or a verifiers environment),
beside the same job with the reward computed in the controller: does the model learn as well, and what
does the environment cost a step?

Run manual:
    python bench/environments.py                      # ~20 min on 2 cores: both jobs, 20 steps each
    python bench/environments.py --environment verifiers   # the verifiers environment instead
    python bench/environments.py --baseline-run DIR   # reuse a finished quickstart run as the baseline
    python bench/environments.py --smoke              # a minute: the tiny job, checks it runs (CI)

What runs, all real services started by the local launcher (`services.controller run`):
1. the baseline: the quickstart (examples/quickstart.yaml), its reward the controller's math reward;
2. the environment's: examples/openenv/arithmetic.yaml, the same job (model, questions, sampling,
   steps, validation) whose episodes are sessions of the example environment server
   (examples/openenv/arithmetic, started here from .venv-openenv on a free port): the environment
   asks each question (the data set's, passed to its reset) and grades the answer, its reward the
   one trained, its `accuracy` the validation's;
   or, with --environment verifiers, examples/verifiers/arithmetic.yaml: the same job whose episodes are
   played by the example verifiers taskset (examples/verifiers/flywheel_arithmetic) in verifiers' own
   harness, against the rollout's sessions (the controller starts verifiers' host in .venv-verifiers).

Reported: both validation curves (held-out accuracy every `--val-interval` steps), the environment
run's rise over its first validation, and the mean seconds a training step took on each side. Ends
with one JSON line; `<environment>_step_vs_inprocess` is the ratio of step seconds (the environment's cost).
In --smoke the tiny random model learns nothing: only that the machinery runs is checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from bench.quickstart_job import QUICKSTART, QUICKSTART_TINY, curve, run_job, section, step_seconds, work_dir  # noqa: E402
from flywheel.testing.environments import example_environment  # noqa: E402
from flywheel.testing.records import record  # noqa: E402

RUN_FILES = {"openenv": ROOT / "examples" / "openenv" / "arithmetic.yaml",
             "verifiers": ROOT / "examples" / "verifiers" / "arithmetic.yaml"}


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--environment", choices=sorted(RUN_FILES), default="openenv", help="the environment played")
    ap.add_argument("--steps", type=int, default=20, help="steps of each job")
    ap.add_argument("--val-interval", type=int, default=5, help="validation every N steps, on both sides")
    ap.add_argument("--baseline-run", type=Path, default=None,
                    help="a finished quickstart run directory to take the baseline from instead of running it")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs go, kept (default: a temporary directory, removed at the end)")
    # The smoke validates before training and at its end: a curve's two ends are all its figures read, and
    # every validation episode of the verifiers side is a chat program started for it (docs/environments.md).
    return parse_with_smoke(ap, "the tiny job, 2 steps a side", steps=2, val_interval=2)


def main() -> None:
    args = parse_args()
    with work_dir(args.work, "flywheel-environments-") as work:
        base = QUICKSTART_TINY if args.smoke else QUICKSTART
        baseline = args.baseline_run or run_job(base, work, "inprocess", args.steps, args.val_interval, smoke=args.smoke)
        name = args.environment
        # The environment's run file is the quickstart's with the worker swapped; on --smoke the tiny job's,
        # swapped the same way.
        worker = {**section(base, "worker"), **section(RUN_FILES[name], "worker"),
                  "group_size": section(base, "worker")["group_size"],
                  "max_in_flight": section(base, "worker")["max_in_flight"]}
        worker.pop("instruction", None)  # the math worker's; the environment asks the questions
        if name == "verifiers":
            # The taskset's prompts are the questions, its system prompt the quickstart's (run_job merges this
            # worker over the base's: None clears what the verifiers worker refuses).
            worker.update(instruction=None, system_prompt=None)
            worker["verifiers"] = {**worker["verifiers"], "path": [str(ROOT / p) for p in worker["verifiers"]["path"]]}
            played = run_job(base, work, name, args.steps, args.val_interval, {"worker": worker}, drop=("reward",),
                             smoke=args.smoke)
        else:
            with example_environment(work / "environment.log") as url:
                worker["env"] = {**worker["env"], "url": url}
                played = run_job(base, work, name, args.steps, args.val_interval, {"worker": worker}, drop=("reward",),
                                 smoke=args.smoke)
        inprocess, environment = curve(baseline), curve(played)
        inprocess = {step: value for step, value in inprocess.items() if step <= args.steps}
        figures = {
            "environment": name,
            "steps": args.steps,
            "inprocess_curve": {str(k): v for k, v in sorted(inprocess.items())},
            f"{name}_curve": {str(k): v for k, v in sorted(environment.items())},
            f"{name}_rise": round(environment[max(environment)] - environment[0], 4),
            "inprocess_rise": round(inprocess[max(inprocess)] - inprocess[0], 4),
            "inprocess_step_seconds": round(step_seconds(baseline), 2),
            f"{name}_step_seconds": round(step_seconds(played), 2),
            "baseline_from": "this run" if args.baseline_run is None else str(args.baseline_run),
            f"{name}_step_vs_inprocess": round(step_seconds(played) / step_seconds(baseline), 3),
        }
        record("environments", figures, args=vars(args), smoke=args.smoke)


if __name__ == "__main__":
    main()
