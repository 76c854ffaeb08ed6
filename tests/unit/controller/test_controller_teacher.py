"""On-policy distillation: the teacher's log-probs of the sampled tokens line up with them, become
per-token advantages (kl_coef x (teacher - sampling log-prob) + reward_coef x the group's), reach the
trainer as [B, T]; a teacher that fails is retried, its group failed and counted (never trained without
it), and one that fails every call stops the run after the configured count."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
import torch

from services.controller.assemble import build_pipeline
from services.controller.batches.algorithms import distill_advantages, distilled
from services.controller.batches.batching import build_train_batch
from services.controller.domain import TrajectoryStatus
from services.controller.loop import run
from services.controller.run_config import TeacherConfig
from services.controller.tasks.teacher import Teacher
from services.controller.telemetry.errors_report import ErrorReporter
from services.controller.testing.simulated import (
    SimulatedRolloutEngine, SimulatedTrainer, constant, lognormal, run_virtual, simulated_services,
)
from tests.unit.controller.controller_helpers import config, items, trajectory

TEACHER = {"addresses": ["teacher:1"], "timeout_seconds": 1.0, "retry_backoff_seconds": 0.01}


def next_token_logprobs(sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """A teacher whose log-prob of a token is minus a thousandth of its id: alignment shows in the values."""
    return [[-ids[i + 1] / 1000 for i in range(len(ids) - 1)] for ids in sequences]


async def perfect(sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
    return next_token_logprobs(sequences)


async def test_the_teachers_log_prob_of_each_response_token_is_kept_where_the_policy_made_it() -> None:
    t = trajectory(response=3)
    t.response_mask = [1, 0, 1]  # the middle token is a tool's output
    t.response_logprobs = [-0.5, 0.0, -0.25]
    teacher = Teacher(TeacherConfig(**TEACHER), perfect)
    assert await teacher.score_group([t]) is None
    assert t.teacher_logprobs == [-0.010, 0.0, -0.012]  # response ids 10, 11, 12
    m = teacher.metrics()
    assert m["teacher/scored_total"] == 1 and m["teacher/tokens"] == 2
    assert m["teacher/reverse_kl"] == pytest.approx(((-0.5 + 0.010) + (-0.25 + 0.012)) / 2)
    assert "teacher/reverse_kl" not in teacher.metrics(), "per step: taken once"


async def test_failed_and_late_calls_are_retried_and_a_group_never_scored_fails_with_the_reason() -> None:
    calls: list[int] = []

    async def flaky(sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
        calls.append(attempt)
        if attempt == 0:
            raise ConnectionError("refused")
        if attempt == 1:
            await asyncio.sleep(10)  # past the deadline
        return next_token_logprobs(sequences)

    teacher = Teacher(TeacherConfig(**TEACHER), flaky)
    group = [trajectory(index=i) for i in range(2)]
    assert await teacher.score_group(group) is None and calls == [0, 1, 2]
    assert teacher.counts["retries"] == 2 and teacher.counts["timeouts"] == 1
    assert all(t.teacher_logprobs is not None for t in group)

    async def down(sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
        raise ConnectionError("no route to the teacher")

    errors = ErrorReporter("stop_on_critical")
    teacher = Teacher(TeacherConfig(**TEACHER, max_attempts=2, max_consecutive_failures=2), down, errors)
    for n in (1, 2):
        group = [trajectory(index=i) for i in range(2)]
        reason = await teacher.score_group(group)
        assert reason is not None and "no route to the teacher" in reason and "2 call(s) failed" in reason
        assert all(t.status == TrajectoryStatus.FAILED and t.error == reason and t.teacher_logprobs is None
                   for t in group)
        assert errors.counts["critical"] == (n == 2)


async def test_an_answer_that_does_not_fit_the_sequence_is_a_failure_not_a_guess() -> None:
    async def short(sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
        return [s[:-1] for s in next_token_logprobs(sequences)]

    teacher = Teacher(TeacherConfig(**TEACHER), short)
    t = trajectory()
    reason = await teacher.score_group([t])
    assert reason is not None and "4 log-probs for a sequence of 6 tokens" in reason
    assert t.status == TrajectoryStatus.FAILED


def test_each_token_is_weighed_by_its_distance_to_the_teacher_plus_the_groups_reward_advantage() -> None:
    a, b = trajectory(index=0, reward=1.0), trajectory(index=1, reward=0.0)
    a.response_mask = [1, 0, 1]
    for t in (a, b):
        t.response_logprobs = [-0.5, -0.5, -0.5]
        t.teacher_logprobs = [-0.1, -2.0, -1.0]
    process = distilled(lambda group: [setattr(t, "advantage", 2 * t.reward - 1) for t in group] and None,
                        kl_coef=2.0, reward_coef=0.5)
    assert process([a, b]) is None
    assert a.token_advantages == pytest.approx([2 * 0.4 + 0.5, 0.0, 2 * -0.5 + 0.5])
    assert b.token_advantages == pytest.approx([2 * 0.4 - 0.5, 2 * -1.5 - 0.5, 2 * -0.5 - 0.5])
    b.teacher_logprobs = None
    with pytest.raises(ValueError, match="no teacher log-prob"):
        distill_advantages(b, 1.0, 0.0)


def test_per_token_advantages_reach_the_trainer_on_the_response_positions() -> None:
    a, b = trajectory(response=3, index=0), trajectory(response=2, index=1)
    a.token_advantages, b.advantage = [0.1, -0.2, 0.3], 0.7
    batch = build_train_batch([a, b], target_version=0)
    adv = batch.tensors["advantages"]
    assert adv.shape == (2, 6)  # prompt 3 + the longest response 3
    assert torch.allclose(adv[0], torch.tensor([0, 0, 0, 0.1, -0.2, 0.3]))
    assert torch.allclose(adv[1], torch.tensor([0, 0, 0, 0.7, 0.7, 0]))
    # Without a teacher: one advantage per sequence, as before.
    b.token_advantages, a.token_advantages, a.advantage = None, None, 0.1
    assert build_train_batch([a, b], target_version=0).tensors["advantages"].shape == (2,)


def test_a_teacher_with_dynamic_sampling_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="algorithm.teacher: dynamic sampling"):
        config(algorithm={"name": "dapo", "train_batch_size": 8, "teacher": TEACHER})
    assert config(algorithm={"name": "dapo", "dynamic_sampling": False, "train_batch_size": 8,
                             "teacher": TEACHER}).algorithm.teacher is not None
    with pytest.raises(ValueError, match="addresses"):
        config(algorithm={"train_batch_size": 8, "teacher": {"addresses": []}})


def distilled_run(score, *, steps: int = 4, policy: str = "stop_on_critical", teacher: dict | None = None):
    rng = random.Random(0)
    cfg = config(mode="fully-async", errors={"policy": policy}, worker={"max_in_flight": 4, "max_retries": 50},
                 algorithm={"train_batch_size": 8, "teacher": {**TEACHER, **(teacher or {})}},
                 data={"train": {"items": items(400)}}, run={"max_steps": steps})
    engine = SimulatedRolloutEngine(gen_time=lognormal(0.5, 0.5, rng), update_time=constant(0.001), rng=rng)
    services = simulated_services(SimulatedTrainer(train_time=constant(0.05), export_time=constant(0.001)), [engine])
    services.teacher = score
    pipeline = build_pipeline(cfg, services, keep_history=True, retry_backoff_seconds=0.01)
    batches, written = [], []
    pipeline.hooks.on_record.append(lambda batch, result, m: (batches.append(batch), written.append(m)))
    return run_virtual(run(pipeline)), pipeline, batches, written


def test_a_distilled_run_trains_every_token_on_its_distance_to_the_teacher() -> None:
    summary, pipeline, batches, written = distilled_run(perfect)
    assert summary.steps == 4, summary.stop_reason
    for batch in batches:
        adv, mask = batch.tensors["advantages"], batch.tensors["loss_mask"]
        assert adv.dim() == 2
        for row, t in enumerate(batch.trajectories):
            p = len(t.prompt_ids)
            want = [-token / 1000 - sampled for token, sampled in zip(t.response_ids, t.response_logprobs)]
            got = adv[row, p:p + len(t.response_ids)]
            assert torch.allclose(got, torch.tensor(want) * mask[row, p:p + len(t.response_ids)], atol=1e-6)
    assert written[-1]["teacher/scored_total"] >= 8 and written[-1]["teacher/failed_total"] == 0
    assert written[-1]["teacher/reverse_kl"] == written[-1]["teacher/reverse_kl"]  # a number, not NaN


def test_a_teacher_that_fails_every_call_stops_the_run_after_the_configured_count() -> None:
    async def down(sequences: Sequence[Sequence[int]], attempt: int) -> list[list[float]]:
        raise ConnectionError("teacher replica unreachable")

    summary, pipeline, batches, _ = distilled_run(down, teacher={"max_attempts": 2, "max_consecutive_failures": 3})
    assert summary.steps == 0 and not batches
    assert "teacher critical" in summary.stop_reason and "3 groups in a row" in summary.stop_reason
    assert "teacher replica unreachable" in summary.stop_reason
    assert pipeline.teacher is not None and pipeline.teacher.counts["scored"] == 0
