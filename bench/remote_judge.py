"""Generation against a flaky remote judge: judged asynchronously vs inside the generation slot.

Run manual:
    python bench/remote_judge.py            # virtual time: ~10 s on 2 cores, the same figures on any machine
    python bench/remote_judge.py --http     # real time, the judge served over HTTP from its own process
    python bench/remote_judge.py --smoke    # seconds: checks it runs (CI)

What runs: the real controller pipeline (fully-async, so that only scores can hold generation back,
and a trainer faster than generation) against the *simulated* services of
services/controller/testing/simulated/, with the reward from a simulated judge
(flywheel/testing/judge.py): each call fails with probability --fail, hangs past the deadline with
probability --late, and otherwise answers after a lognormal time of mean --judge-ms. reward.judge
retries a call up to 3 times, each with a deadline of --timeout-ms. By default on a virtual clock
(the judge in-process): what is measured is the scheduling alone, not how busy the machine is.
With --http the judge is a real HTTP server on 127.0.0.1 in a process of its own and the run is in
real time: on a loaded machine its answers slow down, and late answers are retried, which the
figures then show.

Two ways, same seed and settings: `async` (the default: a group's generation slot goes to the next
task while its scores are awaited, reward.judge.groups_in_flight extra slots) and `inline`
(groups_in_flight 0: generation waits for every score, the baseline).

Reported per way: generation_idle_fraction (the share of the time from the first generation's
start to the last one's end during which no generation ran), trained samples/s, failed judgements
(their trajectories failed and counted, never trained) and how many trained rewards differ from
the judge's answer for their completion (rewards_not_from_the_judge: must be 0). Ends with one
JSON line; `async_vs_inline` is the ratio of samples/s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import parse_with_smoke  # noqa: E402
from bench.simulated_job import job_config, job_parser  # noqa: E402
from flywheel.testing.judge import FlakyJudge, GenerationClock, judge_server, reward_of  # noqa: E402
from flywheel.testing.records import record  # noqa: E402
from services.controller.assemble import Services, build_pipeline  # noqa: E402
from services.controller.loop import run  # noqa: E402
from services.controller.testing.simulated import (  # noqa: E402
    SimulatedRolloutEngine, SimulatedTrainer, constant, lognormal, normal, run_virtual, simulated_services,
)


def parse_args() -> argparse.Namespace:
    ap = job_parser(__doc__, steps=30, in_flight=8)
    ap.add_argument("--gen-ms", type=float, default=200.0, help="mean Generate time of a group, ms")
    judge = ap.add_argument_group("the judge")
    judge.add_argument("--judge-ms", type=float, default=200.0, help="mean time of a call that answers, ms")
    judge.add_argument("--timeout-ms", type=float, default=1000.0, help="deadline of one call, ms")
    judge.add_argument("--fail", type=float, default=0.2, help="share of calls that fail")
    judge.add_argument("--late", type=float, default=0.1, help="share of calls answered past any deadline")
    judge.add_argument("--groups-in-flight", type=int, default=None,
                       help="reward.judge.groups_in_flight of the async way; default the product's")
    judge.add_argument("--http", action="store_true", help="a real HTTP judge in real time (default: virtual time)")
    return parse_with_smoke(ap, "4 steps of 16 samples, 50 ms times: checks the bench runs",
                            steps=4, batch=16, gen_ms=50.0, judge_ms=50.0, timeout_ms=300.0)


async def one_way(args: argparse.Namespace, url: str, judge: FlakyJudge | None, groups_in_flight: int | None) -> dict:
    rng = random.Random(args.seed)
    judge_cfg = {"url": url, "timeout_seconds": args.timeout_ms / 1000, "retry_backoff_seconds": 0.01}
    if groups_in_flight is not None:
        judge_cfg["groups_in_flight"] = groups_in_flight
    cfg = job_config(args, worker={"max_retries": 50}, reward={"judge": judge_cfg}, mode="fully-async")
    gen = args.gen_ms / 1000
    trainer = SimulatedTrainer(train_time=normal(gen / 10, 0.1, rng), export_time=constant(0.001))
    clock = GenerationClock()
    engine = clock.wrap(SimulatedRolloutEngine(gen_time=lognormal(gen, 0.5, rng), update_time=constant(0.001), rng=rng))
    services: Services = simulated_services(trainer, [engine])
    services.judge = judge  # None: HTTP to url
    pipeline = build_pipeline(cfg, services, retry_backoff_seconds=0.01)
    trained = []
    pipeline.hooks.on_record.append(lambda batch, result, m: trained.extend(batch.trajectories))
    started = asyncio.get_running_loop().time()
    summary = await run(pipeline)
    wall = asyncio.get_running_loop().time() - started
    assert pipeline.judge is not None
    stats = pipeline.judge.stats
    return {
        "generation_idle_fraction": round(clock.idle_fraction, 4),
        "samples_per_s": round(summary.samples / wall, 1),
        "judge_calls": stats["calls"], "judge_retries": stats["retries"], "judge_timeouts": stats["timeouts"],
        "failed_judgements": stats["failed"],
        "failed_trajectories": pipeline.rollouts.stats["failed_trajectories"],
        "rewards_not_from_the_judge": sum(t.reward != reward_of(t.text) for t in trained),
        "steps": summary.steps, "wall_s": round(wall, 2),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # every failed judgement is logged as an error: expected here
    results = {}
    for name, groups in (("async", args.groups_in_flight), ("inline", 0)):
        if args.http:
            with judge_server(fail=args.fail, late=args.late, latency_seconds=args.judge_ms / 1000, seed=args.seed) as url:
                results[name] = asyncio.run(one_way(args, url, None, groups))
        else:
            judge = FlakyJudge(fail=args.fail, late=args.late, seed=args.seed,
                               latency=lognormal(args.judge_ms / 1000, 0.5, random.Random(args.seed + 1)))
            results[name] = run_virtual(one_way(args, "http://simulated-judge/verify", judge, groups))
    print(f"{'HTTP judge, real time' if args.http else 'in-process judge, virtual time'}; "
          f"Generate ~ lognormal(mean {args.gen_ms} ms); judge call ~ lognormal(mean {args.judge_ms} ms), "
          f"{args.fail:.0%} fail, {args.late:.0%} late, deadline {args.timeout_ms} ms, 3 attempts; "
          f"{args.in_flight} tasks generating; {args.steps} steps of {args.batch}")
    print(f"{'way':<8}{'gen idle':>10}{'samples/s':>11}{'calls':>7}{'retries':>9}{'failed':>8}{'not judge':>11}{'wall s':>8}")
    for name, r in results.items():
        print(f"{name:<8}{r['generation_idle_fraction']:>10.1%}{r['samples_per_s']:>11.1f}{r['judge_calls']:>7}"
              f"{r['judge_retries']:>9}{r['failed_judgements']:>8}{r['rewards_not_from_the_judge']:>11}{r['wall_s']:>8.2f}")
    figures = {
        "workload": {"clock": "real, HTTP judge" if args.http else "virtual", "gen_ms": args.gen_ms, "judge_ms": args.judge_ms, "timeout_ms": args.timeout_ms,
                     "fail": args.fail, "late": args.late, "in_flight": args.in_flight, "batch": args.batch,
                     "group": args.group, "steps": args.steps},
        "generation_idle_fraction": results["async"]["generation_idle_fraction"],
        **results,
        "async_vs_inline": round(results["async"]["samples_per_s"] / max(results["inline"]["samples_per_s"], 1e-9), 3),
    }
    record("remote_judge", figures, args=args, smoke=args.smoke)


if __name__ == "__main__":
    main()
