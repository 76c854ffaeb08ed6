"""Controller pipeline throughput per mode, with simulated engines.

Run manual:
    python bench/pipeline.py                       # defaults below, ~15 s on 2 cores
    python bench/pipeline.py --steps 60 --mean-ms 30 --sigma 1.2
    python bench/pipeline.py --smoke # seconds: checks it runs (CI)

What runs: the real controller pipeline (loader, rollout manager, staleness
gate, trajectory pool, GRPO processor, tensor batches, train worker,
weight-sync controller, main loop), in real time on one asyncio loop, against
the *simulated* engines of services/controller/testing/simulated/:
  - one rollout engine; each Generate call (one task, group_size samples)
    takes a time drawn from a lognormal with mean --mean-ms and log-std
    --sigma (a long tail: the slowest of a batch's calls is typically 2-3x
    the mean);
  - a trainer whose TrainStep takes a time drawn from a normal with the
    same mean (cv --train-cv): equal means;
  - weight export and per-replica load of --sync-ms each (keep mode).
The same seed, data and settings for every mode, one after the other:
sync, batch-async with threshold 1 and 2, fully-async. Up to --in-flight
tasks are rolled out concurrently; the trajectory pool holds twice the
train batch (the default buffer_size_limit).

Reported per mode: trained samples/s over the whole run, trainer idle
fraction (time the trainer had no TrainStep or export running, from the
first batch's arrival to the end: the pipeline fill before it is the same
for every mode and is excluded), mean/max staleness of trained samples and
groups dropped as stale. Ends with one JSON line; ratios are named
`<mode>_vs_sync`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import parse_with_smoke  # noqa: E402
from bench.simulated_job import job_config, job_parser  # noqa: E402
from services.controller.assemble import Services, build_pipeline  # noqa: E402
from services.controller.loop import run  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from services.controller.testing.simulated import (  # noqa: E402
    SimulatedRolloutEngine,
    SimulatedTrainer,
    constant,
    lognormal,
    normal,
    simulated_services,
)

MODES = [("sync", "sync", 0), ("batch_async_1", "batch-async", 1), ("batch_async_2", "batch-async", 2), ("fully_async", "fully-async", 0)]


def parse_args() -> argparse.Namespace:
    ap = job_parser(__doc__, steps=40, in_flight=16)
    times = ap.add_argument_group("simulated times")
    times.add_argument("--mean-ms", type=float, default=40.0, help="mean Generate time = mean TrainStep time, ms")
    times.add_argument("--sigma", type=float, default=1.0, help="log-std of the Generate time (tail weight)")
    times.add_argument("--train-cv", type=float, default=0.1, help="coefficient of variation of TrainStep time")
    times.add_argument("--sync-ms", type=float, default=1.0, help="weight export and per-replica load time, ms")
    return parse_with_smoke(ap, "6 steps of 8 samples: checks the bench runs (CI)", steps=6, batch=8, in_flight=4)


async def one_mode(args: argparse.Namespace, mode: str, threshold: int) -> dict:
    rng = random.Random(args.seed)
    mean = args.mean_ms / 1000
    cfg = job_config(args, mode=mode, staleness={"threshold": threshold})
    trainer = SimulatedTrainer(train_time=normal(mean, args.train_cv, rng), export_time=constant(args.sync_ms / 1000))
    engine = SimulatedRolloutEngine(
        gen_time=lognormal(mean, args.sigma, rng), update_time=constant(args.sync_ms / 1000), rng=rng
    )
    pipeline = build_pipeline(cfg, simulated_services(trainer, [engine]), keep_history=True, retry_backoff_seconds=0.01)
    started = time.perf_counter()
    summary = await run(pipeline)
    wall = time.perf_counter() - started
    stale = [v - s for v, versions in trainer.trained for s in versions]
    return {
        "samples_per_s": round(summary.samples / wall, 1),
        "trainer_idle_fraction": round(summary.trainer_idle_fraction, 4),
        "staleness_mean": round(statistics.fmean(stale), 3),
        "staleness_max": max(stale),
        "stale_groups_dropped": pipeline.processor.dropped.get("stale", 0),
        "steps": summary.steps,
        "wall_s": round(wall, 2),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)
    results = {}
    for name, mode, threshold in MODES:
        results[name] = asyncio.run(one_mode(args, mode, threshold))
    print(f"Generate ~ lognormal(mean {args.mean_ms} ms, sigma {args.sigma}); TrainStep ~ normal(mean {args.mean_ms} ms, "
          f"cv {args.train_cv}); batch {args.batch} = {args.batch // args.group} tasks x {args.group}; {args.steps} steps")
    print(f"{'mode':<15}{'samples/s':>11}{'vs sync':>9}{'trainer idle':>14}{'stale mean':>12}{'stale max':>11}{'dropped':>9}{'wall s':>8}")
    base = results["sync"]["samples_per_s"]
    for name, r in results.items():
        print(f"{name:<15}{r['samples_per_s']:>11.1f}{r['samples_per_s'] / base:>8.2f}x{r['trainer_idle_fraction']:>14.1%}"
              f"{r['staleness_mean']:>12.2f}{r['staleness_max']:>11}{r['stale_groups_dropped']:>9}{r['wall_s']:>8.2f}")
    figures = {
        "workload": {"mean_ms": args.mean_ms, "sigma": args.sigma, "train_cv": args.train_cv, "batch": args.batch,
                     "group": args.group, "in_flight": args.in_flight, "steps": args.steps},
        **results,
        **{f"{name}_vs_sync": round(results[name]["samples_per_s"] / base, 3) for name in results if name != "sync"},
    }
    record("pipeline", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
