"""A remote judge as the reward (reward.judge): the bodies of each format, and
whole simulated runs in virtual time against a judge that fails a fifth of
its calls and answers a tenth too late: no failed judgement becomes a reward,
the failures are counted in the run's metrics, generation goes on while
groups are judged, and a judge that fails every call stops the run."""

from __future__ import annotations

import math
import random

import pytest

from flywheel.runtime.config import ConfigError
from flywheel.testing.judge import FlakyJudge, GenerationClock, reward_of
from services.controller.assemble import build_pipeline
from services.controller.loop import run
from services.controller.run_config import JudgeConfig
from services.controller.tasks.judge import BadAnswer, RemoteJudge, read_answer, request_body
from services.controller.testing.simulated import (
    SimulatedRolloutEngine, SimulatedTrainer, constant, lognormal, normal, run_virtual, simulated_services,
)
from tests.unit.controller.controller_helpers import config, items, task

URL = "http://judge.test/verify"
#: Per call: 1 s on average (a group's generation takes 0.5 s); its deadline 2 s; 20 % fail, 10 % hang.
JUDGE = {"url": URL, "timeout_seconds": 2.0, "retry_backoff_seconds": 0.1, "max_attempts": 3}


def test_each_format_sends_its_body_and_reads_its_answer() -> None:
    t = task(3, answer="42")
    flywheel = request_body("flywheel", t, "it is 42")
    assert flywheel == {"prompt": "question 3", "completion": "it is 42",
                        "metadata": {"task_id": t.id, "split": "train", "answer": "42", "data": {}}}
    assert request_body("slime", t, "it is 42") == {"prompt": "question 3", "response": "it is 42", "label": "42"}
    nemo = request_body("nemo_gym", t, "it is 42")
    assert nemo["responses_create_params"] == {"input": [{"role": "user", "content": "question 3"}]}
    assert nemo["response"]["output"][0]["content"][0] == {"type": "output_text", "text": "it is 42", "annotations": []}
    assert read_answer("flywheel", {"reward": 1, "scores": {"style": 0.5}}) == {"reward": 1.0, "style": 0.5}
    assert read_answer("slime", 0.25) == {"reward": 0.25}
    assert read_answer("nemo_gym", {**nemo, "reward": 0.0}) == {"reward": 0.0}
    for fmt, answer, why in [("nemo_gym", {"reward": 1.0, "mask_sample": True}, "masked"),
                             ("flywheel", {"score": 1}, "no reward"), ("slime", "1", "not a finite number"),
                             ("flywheel", {"reward": math.nan}, "not a finite number")]:
        with pytest.raises(BadAnswer, match=why):
            read_answer(fmt, answer)


def test_a_judge_is_configured_instead_of_a_reward_function() -> None:
    assert config(reward={"judge": JUDGE}).reward.judge == JudgeConfig(**JUDGE)
    with pytest.raises(ConfigError, match="reward: give reward.name"):
        config(reward={"name": "math", "judge": JUDGE})
    with pytest.raises(ConfigError, match="judge.url: must be an http"):
        config(reward={"judge": {"url": "judge:8000"}})


async def test_a_judgement_retries_failed_and_late_calls_within_its_deadline() -> None:
    answers = iter([RuntimeError("HTTP 500"), "late", {"reward": 0.5}])

    async def post(body):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        if answer == "late":
            import asyncio
            await asyncio.sleep(60)
        return answer

    judge = RemoteJudge(JudgeConfig(url=URL, timeout_seconds=0.05, retry_backoff_seconds=0.0), post)
    assert await judge(task(), "x") == {"reward": 0.5}
    assert judge.metrics() == {"judge/calls_total": 3.0, "judge/judged_total": 1.0, "judge/failed_total": 0.0,
                               "judge/retries_total": 2.0, "judge/timeouts_total": 1.0}


def judged_run(judge_cfg: dict, judge: FlakyJudge, *, steps: int = 12, policy: str = "stop_on_critical",
               seed: int = 0, tasks: int = 2000):
    """A fully-async simulated run whose reward is `judge`: generation is the bottleneck (a fast trainer),
    so any idle generation is waiting for scores."""
    rng = random.Random(seed)
    cfg = config(mode="fully-async", reward={"judge": judge_cfg}, errors={"policy": policy},
                 worker={"max_in_flight": 8, "max_retries": 50}, algorithm={"train_batch_size": 16},
                 data={"train": {"items": items(tasks)}}, run={"max_steps": steps, "seed": seed})
    trainer = SimulatedTrainer(train_time=normal(0.02, 0.1, rng), export_time=constant(0.001))
    clock = GenerationClock()
    engine = clock.wrap(SimulatedRolloutEngine(gen_time=lognormal(0.5, 0.5, rng), update_time=constant(0.001), rng=rng))
    services = simulated_services(trainer, [engine])
    services.judge = judge
    pipeline = build_pipeline(cfg, services, keep_history=True, retry_backoff_seconds=0.01)
    trained = []
    pipeline.hooks.on_record.append(lambda batch, result, m: trained.extend(batch.trajectories))
    written = []
    pipeline.hooks.on_record.append(lambda batch, result, m: written.append(m))
    summary = run_virtual(run(pipeline))
    return summary, pipeline, trained, written, clock


def test_failed_judgements_are_counted_never_rewards_and_generation_never_waits_for_scores() -> None:
    judge = FlakyJudge(fail=0.2, late=0.1, latency=lognormal(1.0, 0.5, random.Random(1)), seed=2)
    summary, pipeline, trained, written, clock = judged_run(JUDGE, judge)
    assert summary.steps == 12, summary.stop_reason
    # Every trained reward is the judge's answer for that very completion: none is a failure's stand-in.
    assert trained and all(t.reward == reward_of(t.text) for t in trained)
    remote = pipeline.judge
    assert remote is not None and remote.stats["failed"] > 0 and judge.calls["failed"] > 0 and judge.calls["late"] > 0
    last = written[-1]
    assert last["judge/failed_total"] >= 1 and last["rollout/failed_trajectories_total"] >= last["judge/failed_total"] - 8
    print(f"generation idle {clock.idle_fraction:.3%}; judge {dict(remote.stats)}; simulated {dict(judge.calls)}")
    assert clock.idle_fraction < 0.05


def test_judging_inside_the_generation_slot_leaves_generation_idle() -> None:
    """The baseline the default beats: groups_in_flight 0, generation waits for every score."""
    judge = FlakyJudge(fail=0.2, late=0.1, latency=lognormal(1.0, 0.5, random.Random(1)), seed=2)
    _, _, _, _, clock = judged_run({**JUDGE, "groups_in_flight": 0}, judge, steps=6)
    assert clock.idle_fraction > 0.05


def test_a_judge_that_fails_every_call_stops_the_run_after_the_configured_count() -> None:
    judge = FlakyJudge(fail=1.0, latency=constant(0.2))
    summary, pipeline, trained, _, _ = judged_run({**JUDGE, "max_consecutive_failures": 5}, judge)
    assert summary.steps == 0 and not trained
    assert "judge critical" in summary.stop_reason and "failed 5 judgements in a row" in summary.stop_reason
    assert "simulated judge failure" in summary.stop_reason
    assert pipeline.judge is not None and pipeline.judge.stats["judged"] == 0
    # Under errors.policy continue, the same judge is recorded and the run goes on (to no avail).
    summary, pipeline, _, _, _ = judged_run({**JUDGE, "max_consecutive_failures": 5}, FlakyJudge(fail=1.0),
                                            policy="continue", steps=1, tasks=16)
    assert pipeline.errors.counts["critical"] >= 1 and "judge" not in (summary.stop_reason or "")
