"""On-policy distillation against GRPO on the quickstart job: steps to the teacher's accuracy.

Run manual:
    python bench/distill.py                       # ~20 min on 2 cores: GRPO's quickstart, then distillation
    python bench/distill.py --teacher-run DIR     # reuse a finished quickstart run as teacher and baseline
    python bench/distill.py --smoke               # a minute or two: the tiny job, checks it runs (CI)

What runs, in order, all real services started by the local launcher (`services.controller run`):
1. GRPO: the quickstart job (examples/quickstart.yaml, its `--grpo-steps` steps). Its final checkpoint
   is the teacher, and its held-out accuracy at the end (validated on the final weights) the
   teacher's accuracy; its validation curve is the baseline.
2. Distillation: the same job from the base model again, with `algorithm.teacher` naming a rollout
   replica this bench starts on the teacher's checkpoint (the transformers engine, standalone), the
   reward's advantage left out by default (`--reward-coef` 0: the teacher's per-token log-probs alone), sampled at
   `--temperature` (1.0: the reverse KL is to the student's own distribution), validated on the same
   held-out questions at the same interval.

Reported: each side's validation curve, the teacher's accuracy, the first step at which the student
is within `--within` of it (`distill_steps`) and the first at which GRPO did (`grpo_steps`), both on
the validation grid (every `--val-interval` steps). Ends with one JSON line;
`distill_steps_vs_grpo_steps` is their ratio (below 1: distillation got there in fewer steps).
In --smoke the tiny random model is its own teacher (accuracy near 0 on both sides): only that the
machinery runs is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from bench.quickstart_job import QUICKSTART, QUICKSTART_TINY, curve, first_step, run_job, section, work_dir  # noqa: E402
from flywheel.launcher.processes import start_service  # noqa: E402
from flywheel.testing.records import record  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--grpo-steps", type=int, default=30, help="steps of the GRPO quickstart that trains the teacher")
    ap.add_argument("--steps", type=int, default=20, help="steps of distillation")
    ap.add_argument("--val-interval", type=int, default=5, help="validation every N steps, on both sides")
    ap.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature")
    ap.add_argument("--kl-coef", type=float, default=1.0, help="algorithm.teacher.kl_coef")
    ap.add_argument("--reward-coef", type=float, default=0.0,
                    help="algorithm.teacher.reward_coef: the task reward's group advantage mixed in (0: none)")
    ap.add_argument("--within", type=float, default=0.05, help="how close to the teacher's accuracy counts")
    ap.add_argument("--teacher-run", type=Path, default=None,
                    help="a finished quickstart run directory to take the teacher and GRPO's curve from "
                         "instead of running it here")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs go, kept (default: a temporary directory, removed at the end)")
    return parse_with_smoke(ap, "the tiny job, 2 steps a side", grpo_steps=2, steps=2, val_interval=1)


def teacher_replica(model: Path, work: Path, max_model_len: int):
    """A standalone rollout replica serving the teacher's checkpoint (Score only is asked of it)."""
    directory = work / "teacher"
    directory.mkdir(parents=True, exist_ok=True)
    config = {"http_port": 0, "engine": {"kind": "transformers", "model_path": str(model),
                                          "args": {"dtype": "float32", "max_model_len": max_model_len}}}
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    child = start_service("rollout", directory, ["--config", str(directory / "config.yaml")], python=sys.executable)
    child.wait_ready(600)
    return child


def main() -> None:
    args = parse_args()
    base = QUICKSTART_TINY if args.smoke else QUICKSTART
    with work_dir(args.work, "flywheel-distill-") as work:
        started = time.monotonic()
        teacher_run = args.teacher_run or run_job(base, work, "grpo", args.grpo_steps, args.val_interval,
                                                  smoke=args.smoke)
        grpo_seconds = time.monotonic() - started
        grpo = curve(teacher_run)
        teacher_model = Path(json.loads((teacher_run / "summary.json").read_text())["model"])
        teacher_accuracy = grpo[max(grpo)]  # validated on the final checkpoint's weights: the teacher's
        max_model_len = yaml.safe_load(base.read_text())["launch"]["rollout"]["engine"]["args"]["max_model_len"]
        teacher = teacher_replica(teacher_model, work, max_model_len)
        try:
            started = time.monotonic()
            worker = section(base, "worker")
            distill_dir = run_job(base, work, "distill", args.steps, args.val_interval, {
                "algorithm": {**section(base, "algorithm"),
                              "teacher": {"addresses": [teacher.grpc_address], "kl_coef": args.kl_coef,
                                          "reward_coef": args.reward_coef}},
                "worker": {**worker, "sampling": {**worker["sampling"], "temperature": args.temperature}},
            }, smoke=args.smoke)
            distill_seconds = time.monotonic() - started
        finally:
            teacher.stop()
        distilled = curve(distill_dir)
        goal = teacher_accuracy - args.within
        distill_steps = first_step(distilled, goal)
        grpo_steps = first_step(grpo, goal)
        metrics = [json.loads(line) for line in (distill_dir / "metrics.jsonl").read_text().splitlines()]
        kls = [m["teacher/reverse_kl"] for m in metrics if "teacher/reverse_kl" in m]
        figures = {
            "teacher_accuracy": teacher_accuracy, "within": args.within,
            "grpo_curve": {str(k): v for k, v in sorted(grpo.items())},
            "distill_curve": {str(k): v for k, v in sorted(distilled.items())},
            "distill_steps": distill_steps, "grpo_steps": grpo_steps,
            "reverse_kl_first": round(kls[0], 4) if kls else None, "reverse_kl_last": round(kls[-1], 4) if kls else None,
            "grpo_minutes": round(grpo_seconds / 60, 1) if args.teacher_run is None else None,
            "distill_minutes": round(distill_seconds / 60, 1),
            "temperature": args.temperature, "reward_coef": args.reward_coef,
            "teacher_from": "this run" if args.teacher_run is None else str(args.teacher_run),
            # Steps on the validation grid; a side that never got there counts its last step + one interval.
            "distill_steps_vs_grpo_steps": round(
                max(1, distill_steps if distill_steps is not None else max(distilled) + args.val_interval)
                / max(1, grpo_steps if grpo_steps is not None else max(grpo) + args.val_interval), 3),
        }
        record("distill", figures, args=vars(args), smoke=args.smoke)


if __name__ == "__main__":
    main()
