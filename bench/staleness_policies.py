"""Batch-async's staleness policies on real services: pace (the default) against drop.

Run manual:
    python bench/staleness_policies.py             # 3 runs a policy of 30 steps, ~5 min on 2 cores
    python bench/staleness_policies.py --smoke     # one run a policy of 3 steps: checks it runs (CI)

What runs: the tiny quickstart (examples/quickstart-tiny.yaml: batch-async, staleness threshold 1, the
launcher starting a real synchronizer, trainer and rollout replica) `--steps` steps from scratch, once
per policy and seed, alternating (pace, drop, pace, drop, ...) so that a slow patch of the machine
falls on both. Validation and checkpoints are off: the figures are the training job's alone.

Reported per policy: finished groups dropped for staleness (pace's promise: 0), the job's wall seconds
from the services being ready, the trainer's idle fraction, and the mean staleness of trained samples,
each a mean over the runs. The stated margin (docs/architecture.md, batch-async): pace's trainer idle
fraction within drop's + 0.05. Ends with one JSON line; `pace_vs_drop` is the ratio of wall seconds and
`pace_idle_vs_drop` of idle fractions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import bench_parser, parse_with_smoke  # noqa: E402
from bench.quickstart_job import QUICKSTART_TINY, run_job, section, work_dir  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
POLICIES = ("pace", "drop")
#: pace's trainer idle fraction may exceed drop's by this much of the wall time (docs/architecture.md).
MARGIN = 0.05


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=30, help="trainer steps a run")
    ap.add_argument("--runs", type=int, default=3, help="runs a policy (seeds 0, 1, ...)")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs go, kept (default: a temporary directory, removed at the end)")
    return parse_with_smoke(ap, "one run a policy of 3 steps", steps=3, runs=1)


def one_run(work: Path, policy: str, seed: int, steps: int, smoke: bool) -> dict:
    base = QUICKSTART_TINY
    run_dir = run_job(base, work, f"{policy}-{seed}", steps, None, checkpoint=False, smoke=smoke, edit={
        "run": {"seed": seed},
        "launch": {**section(base, "launch"),
                   "dataset": {**section(base, "launch")["dataset"], "train_size": 4 * steps}},  # one epoch
        "staleness": {**section(base, "staleness"), "policy": policy},
    })
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staleness = [r["staleness/mean"] for r in rows if "staleness/mean" in r]
    return {
        "steps": summary["steps_this_session"],
        "dropped": sum(summary.get("dropped", {}).values()),
        "job_seconds": summary["job_seconds_this_session"],
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
    }


def main() -> None:
    args = parse_args()
    with work_dir(args.work, "flywheel-policies-") as work:
        runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
        for seed in range(args.runs):
            for policy in POLICIES:
                runs[policy].append(one_run(work, policy, seed, args.steps, args.smoke))
                print(f"{policy} seed {seed}: {runs[policy][-1]}", file=sys.stderr, flush=True)
        means = {policy: {key: round(statistics.fmean(r[key] for r in rs), 4) for key in rs[0]}
                 for policy, rs in runs.items()}
        pace, drop = means["pace"], means["drop"]
        figures = {
            "steps": args.steps, "runs": args.runs, **{policy: means[policy] for policy in POLICIES},
            "pace_dropped_total": sum(r["dropped"] for r in runs["pace"]),
            "pace_idle_within_margin": pace["trainer_idle_fraction"] <= drop["trainer_idle_fraction"] + MARGIN,
            "pace_vs_drop": round(pace["job_seconds"] / drop["job_seconds"], 3),
            "pace_idle_vs_drop": round(pace["trainer_idle_fraction"] / max(drop["trainer_idle_fraction"], 1e-9), 3),
        }
        record("staleness_policies", figures, args=vars(args), smoke=args.smoke)


if __name__ == "__main__":
    main()
