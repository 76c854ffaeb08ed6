"""The simulated GRPO job that bench/pipeline.py and bench/remote_judge.py time under different loads.

Arithmetic questions, a math worker, GRPO, nothing written to disk, run on the simulated services of
services/controller/testing/simulated/: its command-line options and its run config live here once,
and each bench adds only what it varies (timings, modes, a judge).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.arguments import bench_parser
from services.controller.run_config import RunConfig, parse_run_config


def job_parser(doc: str | None, *, steps: int, in_flight: int) -> argparse.ArgumentParser:
    """A bench parser with the job's options; `steps` and `in_flight` are the bench's defaults for them."""
    parser = bench_parser(doc)
    parser.add_argument("--steps", type=int, default=steps, help="trainer steps of each run compared")
    parser.add_argument("--batch", type=int, default=32, help="samples per train batch")
    parser.add_argument("--group", type=int, default=4, help="samples per task (GRPO group)")
    parser.add_argument("--in-flight", type=int, default=in_flight,
                        help="tasks generating at once (worker.max_in_flight)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def job_config(args: argparse.Namespace, *, worker: dict[str, Any] | None = None, **sections: Any) -> RunConfig:
    """The job's run config from the options of `job_parser`: `worker` adds keys to its worker section,
    `sections` add top-level ones (mode, staleness, reward)."""
    items = [{"prompt": f"question {i}", "answer": str(i % 4)} for i in range(args.steps * args.batch * 4)]
    return parse_run_config({
        "run": {"max_steps": args.steps, "seed": args.seed},
        "data": {"train": {"items": items}},
        "worker": {"type": "math", "group_size": args.group, "max_in_flight": args.in_flight, **(worker or {})},
        # Every group counts (no dynamic sampling), so the runs compared train the same number of samples.
        "algorithm": {"name": "grpo", "train_batch_size": args.batch},
        "checkpoint": {"at_end": False},
        "metrics": {"jsonl": False},
        **sections,
    })
